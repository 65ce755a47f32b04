"""Backups: each committed step copied to other roots, in the background.

Why a second root: a region outage or a deleted bucket must not cost the run.
After a step commits on the primary, the coordinator copies it to every backup
target on one background thread (saves and training never wait for it):

* ``mode="copy"``: objckpt copies the step. Same provider and options: the
  provider copies server-side (S3 CopyObject/UploadPartCopy, GCS rewrite) and
  reports a CRC32C of the copy; otherwise bytes stream through this host. Every
  object is checked against the primary manifest's CRC32C and the backup's
  manifest is written last, create-only, so a backup step is committed exactly
  like a primary one. The target's own retention policy then runs there.
* ``mode="replicated"``: the buckets replicate themselves (S3 Cross-Region
  Replication, a GCS transfer job). objckpt copies nothing; it polls until the
  replica's manifest and objects exist and match (with the primary's ``.metadata``
  where no manifest names it), and only then counts the
  step as backed up, reading each object back at most once
  (:mod:`objckpt.ops.run.backup_wait`). Deletion there is the replication rules' business.

Primary retention never deletes a step whose backup is still being made.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from objckpt.errors import BackupError, ConfigurationError, InternalError
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepInfo, StepPlaces
from objckpt.format.steps import committed_steps as list_committed
from objckpt.ops.maintain.gc import delete_step
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.maintain.verify import copy_checkpoint, open_manifest
from objckpt.ops.run.backup_wait import VerifiedObjects, await_backup, replica_manifest
from objckpt.writers import open_store
from objckpt.writers.location import Location

__all__ = ["MODES", "BackupStatus", "BackupTarget", "Replicator", "lag_of"]

logger = logging.getLogger(__name__)

MODES = ("copy", "replicated")


@dataclasses.dataclass(frozen=True)
class BackupTarget:
    """A backup root.

    Attributes:
        url: The root the steps are copied under (same step names as the primary).
        storage_options: fsspec options to reach it (kept out of ``repr``).
        mode: ``"copy"`` (objckpt copies) or ``"replicated"`` (the store replicates;
            objckpt checks).
        retention: The target's own policy; None keeps what the primary keeps.
            Applied to ``copy`` targets only.
        replica_timeout: Seconds a ``replicated`` target may take to show a step.
    """

    url: str
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    mode: str = "copy"
    retention: RetentionPolicy | None = None
    replica_timeout: float = 900.0

    @classmethod
    def beside(
        cls, backup: str | BackupTarget, primary: Location, options: Mapping[str, Any]
    ) -> BackupTarget:
        """``backup`` as a target of ``primary``: a plain URL on the primary's protocol
        reuses the primary's storage ``options``; another protocol gets none."""
        if isinstance(backup, BackupTarget):
            return backup
        same = Location.parse(backup).protocol == primary.protocol
        return cls(backup, dict(options) if same else {})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(
                f"backup {self.url}: mode={self.mode!r} is invalid: expected one of {MODES}"
            )
        t = self.replica_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigurationError(
                f"backup {self.url}: replica_timeout={t!r} is invalid: expected seconds > 0"
            )
        Location.parse(self.url, self.storage_options)

    @property
    def location(self) -> Location:
        return Location.parse(self.url, self.storage_options)


@dataclasses.dataclass(frozen=True)
class BackupStatus:
    """How far one backup target trails the primary.

    Attributes:
        latest_step: Newest step committed on the target (None: none yet); on a
            ``replicated`` target, the newest this process checked whole there.
        steps_behind: Committed primary steps newer than ``latest_step``.
        seconds_behind: Age of the oldest of those (0 when up to date).
        error: The last failure bringing the target up to date, if any.
    """

    url: str
    mode: str
    latest_step: int | None
    steps_behind: int
    seconds_behind: float
    error: str | None = None


def lag_of(primary: Iterable[StepInfo], backed_up: Iterable[int], now: float) -> tuple[int, float]:
    """(steps behind, seconds behind) of a target holding ``backed_up`` steps."""
    have = list(backed_up)
    newest = max(have) if have else -1
    pending = [s for s in primary if s.committed and s.step > newest]
    if not pending:
        return 0, 0.0
    times = [s.modified for s in pending if s.modified is not None]
    return len(pending), max(0.0, now - min(times)) if times else 0.0


def committed_steps(root: Location) -> list[StepInfo]:
    """Committed steps under a root: one listing of its step directories and a
    HEAD of each one's manifest (:func:`objckpt.format.steps.committed_steps`),
    never a listing of every rank's objects.

    Raises:
        StoreError: The root cannot be listed.
    """
    store = open_store(root)
    try:
        return list_committed(store)
    finally:
        store.close()


@dataclasses.dataclass
class _TargetState:
    target: BackupTarget
    steps: set[int] = dataclasses.field(default_factory=set)
    error: str | None = None
    #: What polls of a ``replicated`` target found to match (not read again).
    verified: VerifiedObjects = dataclasses.field(default_factory=VerifiedObjects)


class Replicator:
    """Brings backup targets up to date with a primary root, one step at a time.

    Owned by the coordinator's :class:`~objckpt.CheckpointManager`; usable alone
    (``submit(places)`` after a step commits, ``wait()``, ``status()``). Each step
    arrives with its directories (a :class:`~objckpt.format.steps.StepPlaces` whose
    ``backups`` are in the targets' order), so the replicator derives none.

    Args:
        primary: The primary root.
        targets: Where steps go.
        retention: Default policy for ``copy`` targets without their own.
        on_done: Called with the step after every target had its turn (the
            manager re-applies primary retention there).
        poll_interval: Seconds between checks of a ``replicated`` target.
    """

    def __init__(
        self,
        primary: Location,
        targets: Sequence[BackupTarget],
        *,
        retention: RetentionPolicy | None = None,
        on_done: Callable[[int], None] | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        urls = [t.location.url for t in targets]
        if primary.url in urls or len(set(urls)) != len(urls):
            raise ConfigurationError(
                f"backup targets must differ from each other and from the primary {primary.url}"
            )
        self.primary = primary
        self.retention = retention or RetentionPolicy()
        self._on_done = on_done
        self._poll = poll_interval
        self._lock = threading.Lock()
        self._states = [_TargetState(t) for t in targets]
        self._pending: set[int] = set()
        self._futures: list[concurrent.futures.Future[None]] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-backup")
        self._closed = False

    @property
    def targets(self) -> tuple[BackupTarget, ...]:
        return tuple(s.target for s in self._states)

    def scan(self) -> None:
        """List every target (which steps each holds); a failure is recorded, not raised.

        A ``copy`` target holds the steps it lists: objckpt wrote each manifest there
        last, after checking every object. A ``replicated`` target's listing proves
        only that a manifest arrived (the store copies objects in no order, and may
        have failed to copy some): it holds the listed steps this replicator has
        checked, and no others, so a step listed there but not checked counts as
        lacking (at start the manager submits the newest, and it is checked)."""
        for state in self._states:
            try:
                steps = {s.step for s in committed_steps(state.target.location)}
            except Exception as exc:
                logger.warning("cannot list backup %s: %s", state.target.url, exc)
                with self._lock:
                    state.error = f"cannot list: {exc}"
                continue
            with self._lock:
                state.steps = steps if state.target.mode == "copy" else state.steps & steps

    def lacking(self, step: int) -> list[BackupTarget]:
        """Targets not known to hold ``step``."""
        with self._lock:
            return [s.target for s in self._states if step not in s.steps]

    def pending(self) -> frozenset[int]:
        """Steps whose backups are still being made (primary retention spares them)."""
        with self._lock:
            return frozenset(self._pending)

    def submit(
        self, places: StepPlaces, manifest: Manifest | None = None
    ) -> concurrent.futures.Future[None]:
        """Back ``places.root`` up to every target (``places.backups``), in the background.

        Raises:
            BackupError: The replicator is closed.
            InternalError: ``places`` is not a step under this replicator's primary, or
                does not name one directory per target.
        """
        if len(places.backups) != len(self._states) or places.root.parent().url != self.primary.url:
            raise InternalError(
                f"internal: step {places.step}'s directories ({places.root.url} and "
                f"{len(places.backups)} backup(s)) are not this replicator's "
                f"({self.primary.url} and {len(self._states)} backup target(s))"
            )
        with self._lock:
            if self._closed:
                raise BackupError("the replicator is closed")
            self._pending.add(places.step)
            fut = self._pool.submit(self._replicate, places, manifest)
            self._futures.append(fut)
        return fut

    def _replicate(self, places: StepPlaces, manifest: Manifest | None) -> None:
        step, source = places.step, places.root
        try:
            if manifest is None:
                store = open_store(source)
                try:
                    manifest = open_manifest(store)
                finally:
                    store.close()
            replica: Manifest | None = None  # what a replicated target must hold, once
            for state, dest in zip(self._states, places.backups, strict=True):
                target = state.target
                started = time.monotonic()
                try:
                    if target.mode == "copy":
                        report = copy_checkpoint(source, dest, manifest=manifest)
                        how = f"{report.server_side} server-side, {report.streamed} streamed"
                    else:
                        replica = replica or replica_manifest(source, manifest)
                        await_backup(
                            state.verified,
                            dest,
                            replica,
                            timeout=target.replica_timeout,
                            interval=self._poll,
                        )
                        how = "replicated by the store, checked"
                except Exception as exc:
                    logger.warning("backup of step %d to %s failed: %s", step, target.url, exc)
                    with self._lock:
                        state.error = f"step {step}: {exc}"
                    continue
                with self._lock:
                    state.steps.add(step)
                    state.error = None
                logger.info(
                    "step %d backed up to %s in %.1f s (%s)",
                    step,
                    dest.url,
                    time.monotonic() - started,
                    how,
                )
                if target.mode == "copy":
                    self._apply_retention(state)
        except Exception as exc:
            logger.warning("backup of step %d failed: %s", step, exc)
            with self._lock:
                for state in self._states:
                    state.error = f"step {step}: {exc}"
        finally:
            with self._lock:
                self._pending.discard(step)
            if self._on_done is not None:
                try:
                    self._on_done(step)
                except Exception:
                    logger.warning("after backing up step %d", step, exc_info=True)

    def _apply_retention(self, state: _TargetState) -> None:
        policy = state.target.retention or self.retention
        root = state.target.location
        try:
            steps = committed_steps(root)
            for old in policy.to_delete(steps, time.time()):
                delete_step(StepPlaces.of(old, root).root)
                with self._lock:
                    state.steps.discard(old)
                logger.info("backup retention deleted step %d from %s", old, root.url)
        except Exception as exc:
            logger.warning("backup retention on %s failed: %s", root.url, exc)

    def status(
        self, primary_steps: Iterable[StepInfo], now: float | None = None
    ) -> list[BackupStatus]:
        """Lag of every target against the given primary steps."""
        now = time.time() if now is None else now
        primary = list(primary_steps)
        out = []
        with self._lock:
            states = [(s.target, set(s.steps), s.error) for s in self._states]
        for target, steps, error in states:
            behind, seconds = lag_of(primary, steps, now)
            out.append(
                BackupStatus(
                    url=target.location.url,
                    mode=target.mode,
                    latest_step=max(steps) if steps else None,
                    steps_behind=behind,
                    seconds_behind=seconds,
                    error=error,
                )
            )
        return out

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every backup submitted so far.

        Raises:
            TimeoutError: Still running after ``timeout`` seconds.
            BackupError: A target failed (named with its last error).
        """
        with self._lock:
            futures = list(self._futures)
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        if not_done:
            targets = ", ".join(s.target.url for s in self._states)
            raise TimeoutError(
                f"{len(not_done)} backup(s) to {targets} still running after {timeout} s "
                f"(steps {sorted(self.pending())})"
            )
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            failed = [(s.target.url, s.error) for s in self._states if s.error]
        if failed:
            raise BackupError("; ".join(f"backup {url}: {err}" for url, err in failed))

    def close(self) -> None:
        """Finish the backups in flight, then stop the thread."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
