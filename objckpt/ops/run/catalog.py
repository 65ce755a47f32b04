"""The step catalog: which steps of one run are committed, where, and which retention drops.

Step N lives at ``<root>/step-<N, 10 digits>/`` and exists only once its manifest
is committed, so a listing never names a half-written step. In a process group
only rank 0 lists and the others receive its answer (one LIST per job instead of
one per rank, and one picture for all ranks: a step committing between two ranks'
listings cannot make them disagree).

The catalog keeps two views: steps committed on the root (durable) and steps
committed on the local tier (the coordinator's view, with their commit times),
and the steps that committed since the training loop last asked. Retention is
chosen here, over durable steps only; deleting is the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from objckpt.dcp.collective import Collectives
from objckpt.errors import CheckpointNotFoundError, StepOrderError, StoreError
from objckpt.format.steps import StepInfo, StepPlaces
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.run.backup import BackupTarget, committed_steps
from objckpt.writers.location import Location

__all__ = ["StepCatalog"]

logger = logging.getLogger(__name__)


def _some(value: int | None) -> tuple[int, ...]:
    return () if value is None else (value,)


class StepCatalog:
    """The committed steps of one run, as this rank knows them.

    Args:
        root: The primary root (durable steps).
        retention: Which durable steps to drop.
        local: This rank's local tier root (None without a local tier).
        backups: Backup roots, listed when the primary holds no step.
        collectives: The collectives of the group whose rank 0 lists for all (the
            manager's).
    """

    def __init__(
        self,
        root: Location,
        *,
        retention: RetentionPolicy,
        local: Location | None = None,
        backups: tuple[BackupTarget, ...] = (),
        collectives: Collectives | None = None,
    ) -> None:
        self.root = root
        self.retention = retention
        self.local = local
        self.backups = backups
        self._collectives = collectives or Collectives()
        self._lock = threading.Lock()
        self._steps: dict[int, StepInfo] = {}
        self._local: dict[int, float] = {}  # committed locally: step -> commit time
        # Committed on some node's tier at start (the agreed sweep), kept across
        # reloads: rank 0's listing names only what its own tier holds.
        self._on_nodes: dict[int, float] = {}
        # Steps of copies on the nodes a rollback discarded (the agreed sweep, the
        # restore): never taken from rank 0's listing, until a save of this run
        # begins that step (every rank alike).
        self._discarded: set[int] = set()
        self._finished: list[int] = []
        # The newest step committed at the last listing or started by a save since: the
        # order check's bound. Made only from the broadcast listing and the begin() calls,
        # which every rank makes alike, so every rank refuses the same saves.
        self._high: int | None = None

    # -- listing ----------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-list the root and the local tier on rank 0; every rank takes its answer.

        Every rank of the group must call it together (a collective).

        Raises:
            StoreError: The primary cannot be listed and there is no backup.
        """
        found, local = self._collectives.from_rank0(
            lambda: (self._list_primary(), self._list_local())
        )
        with self._lock:
            self._steps = {s.step: s for s in found}
            self._local = {
                s.step: s.modified or time.time() for s in local if s.step not in self._discarded
            }
            for step, at in self._on_nodes.items():
                self._local.setdefault(step, at)
            self._high = max([*self._steps, *self._local, *_some(self._high)], default=None)

    def newest(self, loadable: Callable[[int], bool] | None = None) -> tuple[int, int | None]:
        """Rank 0: the newest committed step on any tier, and the newest durable one
        (primary, then backups), listed now. ``loadable`` is asked of the local tier's
        steps above the durable ones, newest first, until one may be loaded (the
        restore's rollback check); None: all may.

        Raises:
            CheckpointNotFoundError: No committed step anywhere.
        """
        found = self._list_primary()
        local = self._list_local()
        durable = max((s.step for s in found), default=None)
        if durable is None and self.backups:
            durable = self._newest_backed_up()
        with self._lock:
            local = [s for s in local if s.step not in self._discarded]
        above = sorted((s.step for s in local if durable is None or s.step > durable), reverse=True)
        local_step = next((s for s in above if loadable is None or loadable(s)), None)
        with self._lock:
            self._steps.update({s.step: s for s in found})
            self._local.update({s.step: s.modified or time.time() for s in local})
        newest = max((s for s in (local_step, durable) if s is not None), default=None)
        if newest is None:
            where = self.root.url
            if self.local is not None:
                where += f" or on the local tier {self.local.url}"
            raise CheckpointNotFoundError(f"no committed step under {where}")
        return newest, durable

    def _list_primary(self) -> list[StepInfo]:
        try:
            return committed_steps(self.root)
        except StoreError as exc:
            if not self.backups:
                raise
            logger.warning("primary %s cannot be listed (%s); backups remain", self.root.url, exc)
            return []

    def _list_local(self) -> list[StepInfo]:
        """Rank 0: the steps committed on its local tier (it holds their manifests)."""
        if self.local is None:
            return []
        try:
            return committed_steps(self.local)
        except StoreError as exc:
            logger.warning("local tier %s cannot be listed: %s", self.local.url, exc)
            return []

    def _newest_backed_up(self) -> int | None:
        newest = None
        for target in self.backups:
            try:
                steps = [s.step for s in committed_steps(target.location)]
            except StoreError as exc:
                logger.warning("cannot list backup %s: %s", target.url, exc)
                continue
            if steps and (newest is None or max(steps) > newest):
                newest = max(steps)
        return newest

    # -- views ------------------------------------------------------------------------------
    def durable(self) -> list[StepInfo]:
        """The steps committed on the root."""
        with self._lock:
            return list(self._steps.values())

    def durable_steps(self) -> list[int]:
        """The steps committed on the root, ascending."""
        with self._lock:
            return sorted(self._steps)

    def local_steps(self) -> dict[int, float]:
        """Steps committed on the local tier, with their commit times."""
        with self._lock:
            return dict(self._local)

    def latest(self, *, durable: bool = False) -> int | None:
        """The newest committed step (``durable``: on the root only), or None."""
        with self._lock:
            steps = set(self._steps) if durable else set(self._steps) | set(self._local)
        return max(steps) if steps else None

    def places(self, step: int) -> StepPlaces:
        """Every directory of ``step``: the root's, this rank's local tier's, each
        backup's (the one place a step's directories are derived for a run)."""
        return StepPlaces.of(
            step, self.root, local=self.local, backups=(t.location for t in self.backups)
        )

    def step_url(self, step: int) -> str:
        return self.places(step).root.url

    def local_step_url(self, step: int) -> str | None:
        """This rank's local copy of ``step`` (None without a local tier)."""
        local = self.places(step).local
        return None if local is None else local.url

    # -- changes ----------------------------------------------------------------------------
    def add(self, info: StepInfo) -> None:
        """Coordinator: a step committed on the root."""
        with self._lock:
            self._steps[info.step] = info

    def add_local(self, step: int) -> None:
        """A step committed on the local tier (now)."""
        with self._lock:
            self._local[step] = time.time()
            self._finished.append(step)

    def note_local(self, steps: Collection[int], *, discarded: Collection[int] = ()) -> None:
        """Every rank, at start: ``steps`` are committed on some node's local tier
        (found by the agreed sweep), whether or not rank 0's own tier holds them;
        the copies of ``discarded`` a node kept were discarded by a rollback: not the
        run's steps, whatever rank 0's listing says."""
        self.forget_local(set(discarded) - set(steps))
        now = time.time()
        with self._lock:
            for step in steps:
                self._on_nodes.setdefault(step, now)
                self._local.setdefault(step, now)
            # At start the bound is the broadcast listing's (the same on every rank):
            # a discarded copy rank 0 listed must not hold the run above its steps.
            self._high = max([*self._steps, *self._local], default=None)

    def forget_local(self, steps: Collection[int]) -> None:
        """Every rank alike: the copies of ``steps`` a node holds were discarded by a
        rollback (the sweep or the restore judged them): not the run's steps at this
        or any later listing, until a save of this run begins one of those steps.
        The order check's bound is left as it is (a copy found after the start never
        raised it; the start's own lowers it in :meth:`note_local`)."""
        with self._lock:
            self._discarded |= set(steps)
            for step in steps:
                self._local.pop(step, None)
                self._on_nodes.pop(step, None)

    def finished(self, step: int) -> None:
        """A save of ``step`` to the root ended well (see :meth:`take_finished`)."""
        with self._lock:
            self._finished.append(step)

    def take_finished(self) -> list[int]:
        """Steps that committed since the last call, ascending."""
        with self._lock:
            done, self._finished = self._finished, []
        return sorted(done)

    def add_durable(self, places: StepPlaces) -> None:
        """Non-coordinator ranks learn of a commit on the root, and of retention, here
        (the coordinator deletes what retention drops)."""
        step = places.step
        with self._lock:
            self._steps[step] = StepInfo(step, places.root.url, True, 0, 0, time.time())
            for old in self.retention.to_delete(list(self._steps.values()), time.time()):
                self._steps.pop(old, None)

    def remove(self, step: int) -> None:
        """A durable step was deleted."""
        with self._lock:
            self._steps.pop(step, None)

    def begin(self, step: int, *, loaded: int | None) -> StepPlaces:
        """Every rank, a save of ``step`` starts: refuse it below the newest step of the
        run, else count it as started (later saves must not go below it) and return
        its directories, the one value the save's parts receive.

        Retention ranks steps by number and a restart resumes from the newest, so a
        lower step, saved after a rollback, would be deleted by retention or never
        resumed from. Every rank refuses or starts alike: the bound is made only from
        the broadcast listing and the ``begin`` calls, which every rank makes alike.

        Raises:
            ConfigurationError: ``step`` is not an int >= 0.
            StepOrderError: ``step`` is below the newest step committed or saved (the
                message names both and the way out).
        """
        places = self.places(step)  # a step that is no step at all is refused as such first
        with self._lock:
            high = self._high
            if high is None or step >= high:
                self._high = step
                self._discarded.discard(step)  # this run's own step from now on
                return places
        base = loaded if loaded is not None and loaded < step else None
        back = f"discard_after({base})" if base is not None else "discard_after(<the step loaded>)"
        lost = ""
        if not self.retention.keeps_everything:
            lost = f"retention (which ranks steps by number) would delete step {step} and "
        raise StepOrderError(
            f"step {step} is below step {high}, the newest step committed or saved under "
            f"{self.root.url}: {lost}a restart would resume from step {high}. To continue "
            f"a run rolled back, call CheckpointManager.{back} on every rank first (it "
            f"deletes the committed steps above it), or save a step above {high}"
        )

    def forget_after(self, step: int) -> None:
        """Every rank: the steps above ``step`` were discarded (see
        :meth:`objckpt.CheckpointManager.discard_after`); the next :meth:`reload`
        sets the order check's bound from what is left."""
        with self._lock:
            self._steps = {s: i for s, i in self._steps.items() if s <= step}
            self._local = {s: t for s, t in self._local.items() if s <= step}
            self._on_nodes = {s: t for s, t in self._on_nodes.items() if s <= step}
            # Not reported by maybe_finalize() any more: they are gone.
            self._finished = [s for s in self._finished if s <= step]
            self._high = None

    def above(self, step: int) -> list[int]:
        """Steps above ``step`` committed on the root or the local tier, ascending."""
        with self._lock:
            return sorted(s for s in {*self._steps, *self._local} if s > step)

    def to_delete(self) -> list[int]:
        """The durable steps the retention policy drops now."""
        with self._lock:
            return self.retention.to_delete(list(self._steps.values()), time.time())

    def prune_local(self, policy: RetentionPolicy, spare: set[int]) -> list[tuple[int, bool]]:
        """Forget the local steps ``policy`` drops, all but ``spare``.

        Returns:
            The steps forgotten (to delete from disk), each with whether it is durable.
        """
        with self._lock:
            local = [
                StepInfo(s, "", committed=True, objects=1, bytes=0, modified=at)
                for s, at in self._local.items()
            ]
            doomed = [s for s in policy.to_delete(local, time.time()) if s not in spare]
            for s in doomed:
                self._local.pop(s, None)
                self._on_nodes.pop(s, None)
            return [(s, s in self._steps) for s in doomed]
