"""What follows a commit on the root: record the step, back it up, apply retention.

A step becomes durable when its manifest commits on the primary root, whether a
save wrote it there or a promotion copied it from the local tier. The coordinator
(rank 0) then records it, hands it to the backups' replicator and deletes what the
retention policy drops, sparing steps whose backups are still being made; the other
ranks only record it (and forget what retention drops), so every rank's catalog
agrees without a collective.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from objckpt.errors import BackupError, CheckpointNotFoundError, SaveDeadlineError
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepInfo, StepPlaces
from objckpt.ops.maintain.gc import delete_step
from objckpt.ops.maintain.live_set import ManifestCache
from objckpt.ops.maintain.retire import retire_steps
from objckpt.ops.run.backup import BackupStatus, Replicator, committed_steps
from objckpt.ops.run.catalog import StepCatalog

__all__ = ["DurableSteps"]

logger = logging.getLogger(__name__)

#: How long ``delete`` waits for saves that use the step as their base (as long as
#: ``discard_after`` waits for saves): a save without a deadline may never end.
DELETE_WAIT = 900.0


class DurableSteps:
    """The steps committed on the root, kept: backed up and pruned (coordinator).

    Args:
        catalog: The run's steps; its backups and retention policy apply.
        rank: This process's rank (only rank 0 backs up and deletes).

    Raises:
        ConfigurationError: Backup targets that repeat or name the primary.
    """

    def __init__(self, catalog: StepCatalog, *, rank: int) -> None:
        self._catalog = catalog
        self._rank = rank
        self._manifests: ManifestCache = {}
        self._bases: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()  # guards _bases (never held across a request)
        self._released = threading.Condition(self._lock)  # a base's last save ended
        self._retiring = threading.Lock()  # one retention pass at a time
        self._replicator: Replicator | None = None
        if catalog.backups and rank == 0:
            self._replicator = Replicator(
                catalog.root,
                catalog.backups,
                retention=catalog.retention,
                on_done=self._after_backup,
            )

    def start(self) -> None:
        """After the catalog's first listing: list the backups, and back up the newest
        step where a target lacks it."""
        if self._replicator is None:
            return
        self._replicator.scan()
        latest = self._catalog.latest(durable=True)  # a local-only step has no root copy
        if latest is not None and self._replicator.lacking(latest):
            self._replicator.submit(self._catalog.places(latest))

    def committed(self, places: StepPlaces, manifest: Manifest) -> None:
        """Coordinator, background thread: the step committed on the root
        (``places.root``); record it, back it up, then apply retention."""
        step = places.step
        info = StepInfo(
            step, places.root.url, True, len(manifest.objects), manifest.total_bytes, time.time()
        )
        if manifest.requests is not None:
            logger.info("step %d committed; the save cost %s", step, manifest.requests.summary())
        self._catalog.add(info)
        if self._replicator is not None:
            self._replicator.submit(places, manifest)
        self.apply_retention()

    def _after_backup(self, step: int) -> None:
        self.apply_retention()

    def hold_base(self, step: int) -> Callable[[], None]:
        """A save of this manager uses ``step`` as its base (it references its objects):
        retention spares ``step`` until the returned function is called (once, when
        that save ended, committed or not), which applies retention again.
        """
        with self._lock:
            self._bases[step] += 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._lock:
                self._bases[step] -= 1
                if self._bases[step] <= 0:
                    del self._bases[step]
                    self._released.notify_all()
            if self._rank == 0:
                self.apply_retention()

        return release

    def bases_in_use(self) -> frozenset[int]:
        """Steps saves of this manager use as their base now (spared by retention)."""
        with self._lock:
            return frozenset(self._bases)

    def apply_retention(self) -> None:
        """Coordinator: delete what the policy drops, sparing steps still being backed
        up and the bases of saves in flight."""
        with self._retiring:
            spared = self._replicator.pending() if self._replicator is not None else frozenset()
            # A base held after this point is one the save found as the newest step,
            # which no policy drops; were it dropped anyway, the save's commit finds
            # its referenced objects gone and fails: nothing dangling commits.
            spared = spared | self.bases_in_use()
            doomed = [s for s in self._catalog.to_delete() if s not in spared]
            if not doomed:
                return
            try:
                self._retire(doomed)
            except Exception as exc:  # the save committed; a failed deletion is retried later
                logger.warning("retention could not delete steps %s: %s", doomed, exc)

    def delete(self, step: int) -> None:
        """Delete one step from the root (manifest first; objects other committed steps
        reference stay). When saves of this manager in flight use ``step`` as their
        base, it waits until they ended (each within its deadline): deleted
        meanwhile, their commit would find their referenced objects gone and fail.

        Raises:
            CheckpointNotFoundError: Nothing is stored for ``step``.
        """
        with self._lock:
            if step in self._bases:
                logger.info("deleting step %d once the saves using it as their base end", step)
            if not self._released.wait_for(lambda: step not in self._bases, DELETE_WAIT):
                raise SaveDeadlineError(
                    f"saves using step {step} as their base still run after {DELETE_WAIT:.0f} s; "
                    "nothing was deleted"
                )
        with self._retiring:
            self._retire([step], require=True)

    def _retire(self, steps: list[int], *, require: bool = False) -> None:
        root = self._catalog.root
        retire_steps(root, steps, cache=self._manifests, require=require)
        for step in steps:
            self._catalog.remove(step)
        logger.info("deleted steps %s under %s", steps, root.url)

    def discard_after(self, step: int, timeout: float | None = None) -> list[int]:
        """Coordinator: delete every step above ``step`` committed on the root, and on
        each backup target objckpt copies to (``mode="copy"``, whose retention ranks
        steps by number too), newest first; returns the root's steps deleted, ascending.

        Backups in flight are waited for first (a copy landing afterwards would bring
        a discarded step back). ``replicated`` targets follow the store's replication
        rules, as their retention does.

        Raises:
            StoreError: A listing or a deletion failed; what is left above ``step``
                stays committed, and calling again finishes the job.
            SaveDeadlineError: Backups still copying after ``timeout`` seconds.
        """
        if self._replicator is not None:
            try:
                self._replicator.wait(timeout)
            except BackupError as exc:  # kept for wait_for_backups; the copies ended
                logger.info("backups before discarding the steps above %d: %s", step, exc)
            except TimeoutError as exc:
                raise SaveDeadlineError(
                    f"backups of {self._catalog.root.url} still copying after {timeout:g} s; "
                    "nothing was discarded (call discard_after again)"
                ) from exc
        doomed = sorted(s.step for s in committed_steps(self._catalog.root) if s.step > step)
        for s in reversed(doomed):  # newest first: what is left is always a prefix
            try:
                self.delete(s)
            except CheckpointNotFoundError:
                self._catalog.remove(s)
        if self._replicator is not None:
            for target in self._replicator.targets:
                if target.mode != "copy":
                    continue
                listed = committed_steps(target.location)
                for s in sorted((i.step for i in listed if i.step > step), reverse=True):
                    delete_step(StepPlaces.of(s, target.location).root)
                    logger.info("deleted step %d from the backup %s", s, target.url)
            self._replicator.scan()
        return doomed

    def backup_status(self) -> list[BackupStatus]:
        """How far each backup trails the primary (empty without backups)."""
        if self._replicator is None:
            return []
        return self._replicator.status(self._catalog.durable())

    def wait_for_backups(self, timeout: float | None = None) -> None:
        """Wait until every step handed to the backups is there.

        Raises:
            TimeoutError: Backups still running after ``timeout`` seconds.
            BackupError: A target could not be brought up to date.
        """
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def close(self) -> None:
        """Stop the replicator (waiting for the copies it has started)."""
        if self._replicator is not None:
            self._replicator.close()
