"""What follows a commit on the root: record the step, back it up, apply retention.

A step becomes durable when its manifest commits on the primary root, whether a
save wrote it there or a promotion copied it from the local tier. The coordinator
(rank 0) then records it, hands it to the backups' replicator and deletes what the
retention policy drops, sparing steps whose backups are still being made; the other
ranks only record it (and forget what retention drops), so every rank's catalog
agrees without a collective.
"""

from __future__ import annotations

import logging
import time

from objckpt.errors import BackupError, CheckpointNotFoundError, SaveDeadlineError
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepInfo, step_name
from objckpt.ops.backup import BackupStatus, Replicator, committed_steps
from objckpt.ops.catalog import StepCatalog
from objckpt.ops.gc import delete_step

__all__ = ["DurableSteps"]

logger = logging.getLogger(__name__)


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
        latest = self._catalog.latest()
        if latest is not None and self._replicator.lacking(latest):
            self._replicator.submit(latest)

    def saved(self, step: int, exc: BaseException | None) -> None:
        """Every rank: a save to the root ended (before its handle reports it done)."""
        if exc is not None:
            return
        self._catalog.finished(step)
        if self._rank != 0:
            self._catalog.add_durable(step)

    def committed(self, step: int, url: str, manifest: Manifest) -> None:
        """Coordinator, background thread: record the step, back it up, then apply
        retention."""
        info = StepInfo(step, url, True, len(manifest.objects), manifest.total_bytes, time.time())
        if manifest.requests is not None:
            logger.info("step %d committed; the save cost %s", step, manifest.requests.summary())
        self._catalog.add(info)
        if self._replicator is not None:
            self._replicator.submit(step, manifest)
        self.apply_retention()

    def _after_backup(self, step: int) -> None:
        self.apply_retention()

    def apply_retention(self) -> None:
        """Coordinator: delete what the policy drops, sparing steps still being backed up."""
        spared = self._replicator.pending() if self._replicator is not None else frozenset()
        for old in self._catalog.to_delete():
            if old in spared:
                continue
            try:
                self.delete(old)
            except Exception as exc:  # the save committed; a failed deletion is retried later
                logger.warning("retention could not delete step %d: %s", old, exc)

    def delete(self, step: int) -> None:
        """Delete one step from the root (manifest first).

        Raises:
            CheckpointNotFoundError: Nothing is stored for ``step``.
        """
        root = self._catalog.root
        delete_step(root.child(step_name(step)))
        self._catalog.remove(step)
        logger.info("deleted step %d under %s", step, root.url)

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
                    delete_step(target.location.child(step_name(s)))
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
