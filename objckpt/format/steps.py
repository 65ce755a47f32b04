"""Steps under a root: naming, and one listing that tells what is there.

A manager keeps step N at ``<root>/step-<N, 10 digits>/`` so that a plain
lexical listing sorts by step. A step exists for users only once committed
(its ``manifest.json`` is present); everything else under a step directory is
either part of a committed step or garbage from a failed or in-flight save.

Two ways to look, for two kinds of caller:

- :meth:`~objckpt.writers.base.ObjectStore.inventory`: one recursive listing of
  every object under the root (paginated by the store). ``ls``, gc and the
  deletion of a step need every object's name, size and age, and it costs what
  the root holds: O(ranks x steps) entries, one more request per 1,000 objects.
- :func:`committed_steps`: which steps are committed, and when, from one listing
  of the root's top level (one entry per step directory) and one HEAD of each
  step's manifest. A training job asks this in the manager's constructor and
  in every load, on rank 0 for everyone, so its cost must not grow with the
  world size: a job of 4,096 ranks writes ~8,000 objects per step, and a
  recursive listing of them would be the manager's one O(W) request.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

from objckpt.errors import ConfigurationError
from objckpt.format.layout import MANIFEST_KEY, is_objckpt_object
from objckpt.writers.base import ObjectInfo, ObjectStore
from objckpt.writers.deadline import each_in_context
from objckpt.writers.location import Location, unplaced

__all__ = [
    "ObjectInfo",
    "StepInfo",
    "StepPlaces",
    "committed_steps",
    "parse_step",
    "step_name",
    "steps_of",
]

logger = logging.getLogger(__name__)

STEP_DIGITS = 10
#: Manifest HEADs in flight at once in :func:`committed_steps` (a root that keeps
#: hundreds of steps is answered in a few round trips, not hundreds).
HEAD_CONCURRENCY = 16
# ASCII digits, the whole name: fullmatch (``$`` would let a trailing newline in).
_STEP = re.compile(rf"step-([0-9]{{{STEP_DIGITS},}})")


def step_name(step: int) -> str:
    """``step-0000000100`` for step 100.

    Raises:
        ConfigurationError: ``step`` is not a non-negative int.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigurationError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step number of a directory name, or None if it is not a step directory."""
    m = _STEP.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class StepPlaces:
    """Every directory one step of a run is written to, derived once per save.

    Why one value: a manager's save of step N touches up to four roots (the local
    tier, the primary, each backup target), and each part of the save (placing it,
    its commit, the promotion, the backups) used to derive its own directory from the
    step number. Built once (:meth:`of`, by the run's step catalog) and handed down,
    every part names the same directories, and no part needs to know the roots.

    Attributes:
        step: The step.
        root: Its directory on the primary root (what DCP records as the checkpoint id).
        local: Its directory on this node's local tier (None: the run has none).
        backups: Its directory on each backup target, in the targets' order.
    """

    step: int
    root: Location
    local: Location | None = None
    backups: tuple[Location, ...] = ()

    @classmethod
    def of(
        cls,
        step: int,
        root: Location,
        *,
        local: Location | None = None,
        backups: Iterable[Location] = (),
    ) -> StepPlaces:
        """Step ``step``'s directories under ``root``, ``local`` and each of ``backups``.

        Raises:
            ConfigurationError: ``step`` is not a non-negative int.
        """
        name = step_name(step)
        return cls(
            step,
            root.child(name),
            None if local is None else local.child(name),
            tuple(b.child(name) for b in backups),
        )


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a step directory holds.

    ``objects`` and ``bytes`` count the step directory's objects where it was found
    by an inventory; :func:`committed_steps` reads only the manifest and
    counts that one object (its size).
    """

    step: int
    url: str
    committed: bool
    objects: int
    bytes: int
    modified: float | None  # newest object's time (the commit time, when committed)


def steps_of(objects: Iterable[ObjectInfo], root: Location) -> list[StepInfo]:
    """Step directories found in an inventory, ascending by step (each with the
    objects the root's spread directories hold for it: :func:`unplaced`)."""
    groups: dict[int, list[tuple[str, ObjectInfo]]] = {}
    for obj in objects:
        where = unplaced(obj.key)
        if obj.key.startswith("spread-") and not is_objckpt_object(obj.key):
            where = None  # only objckpt's payloads are ever stored in a spread directory
        step = None if where is None else parse_step(where[0])
        if where is not None and step is not None:
            groups.setdefault(step, []).append((where[1], obj))
    out = []
    for step, named in sorted(groups.items()):
        names = {name for name, _ in named}
        objs = [o for _, o in named]
        times = [o.modified for o in objs if o.modified is not None]
        out.append(
            StepInfo(
                step=step,
                url=root.child(step_name(step)).url,
                committed=MANIFEST_KEY in names,
                objects=len(objs),
                bytes=sum(o.size for o in objs),
                modified=max(times) if times else None,
            )
        )
    return out


def committed_steps(store: ObjectStore) -> list[StepInfo]:
    """The committed steps under ``store``'s location, ascending, without listing
    their objects.

    One listing of the root's top level finds the step directories; one HEAD per
    step directory (:data:`HEAD_CONCURRENCY` at a time) finds its manifest. A step
    is committed iff its manifest exists, so nothing else is looked at; the
    manifest's time is the commit time. Requests: one LIST page per 1,000 step
    directories plus one HEAD per step, whatever the number of ranks that wrote them.

    Raises:
        BucketNotFoundError: The root's bucket does not exist (object stores only).
        StoreError: The listing or a HEAD failed (translated, naming the URL).
    """
    # Only directories named as objckpt names them: a step number written with more
    # digits (made by hand) is another directory, which the manager never uses.
    steps = sorted(
        {
            step
            for name in store.directories()
            if (step := parse_step(name)) is not None and name == step_name(step)
        }
    )
    if not steps:
        return []
    found = each_in_context(
        lambda step: _manifest_of(store, step), steps, lanes=HEAD_CONCURRENCY, name="objckpt-steps"
    )
    return [info for info in found if info is not None]


def _manifest_of(store: ObjectStore, step: int) -> StepInfo | None:
    """Step ``step``'s StepInfo if its manifest exists (one HEAD), else None."""
    where = store.location.child(step_name(step))
    try:
        head = store.head(f"{step_name(step)}/{MANIFEST_KEY}")
    except FileNotFoundError:
        return None
    return StepInfo(step, where.url, True, 1, head.size, head.modified)
