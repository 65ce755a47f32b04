"""Which committed steps to keep: small policy values, combined by union.

A step is kept if *any* rule keeps it (keep the last 3 *and* every 1000th
means both sets survive), the newest committed step is always kept, and only
committed steps are ever considered: a step still uploading has no manifest, so
retention cannot see it, let alone delete it. With no rule set, nothing is
deleted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from objckpt.errors import ConfigurationError
from objckpt.format.steps import StepInfo

__all__ = ["RetentionPolicy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Rules for keeping committed steps.

    Attributes:
        keep_last: Keep the newest N committed steps.
        keep_every: Keep steps that are multiples of K (milestones).
        keep_newer_than: Keep steps committed less than this many seconds ago.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_newer_than: float | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigurationError(
                    f"option {name}={value!r} is invalid: expected an int >= 1 or None"
                )
        t = self.keep_newer_than
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ConfigurationError(
                f"option keep_newer_than={t!r} is invalid: expected seconds > 0 or None"
            )

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_newer_than is None

    def to_delete(self, steps: Sequence[StepInfo], now: float) -> list[int]:
        """Committed steps no rule keeps, ascending (never the newest committed step)."""
        committed = sorted(s.step for s in steps if s.committed)
        if self.keeps_everything or not committed:
            return []
        keep = {committed[-1]}
        if self.keep_last is not None:
            keep.update(committed[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in committed if s % self.keep_every == 0)
        if self.keep_newer_than is not None:
            horizon = now - self.keep_newer_than
            keep.update(
                s.step
                for s in steps
                if s.committed and (s.modified is None or s.modified >= horizon)
            )
        return [s for s in committed if s not in keep]
