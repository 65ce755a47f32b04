"""Promotion: a step committed on the local tier becomes durable on the primary root.

Each rank copies the payload objects it wrote from its local directory to the
primary root, in worker processes of their own (the training process only waits
on futures, and the next local save never queues behind a slow upload), every
object checked against the CRC32C it was written with. The local step is read
through the store layer (:func:`~objckpt.writers.open_store` at its ``file://``
URL, the door the local save wrote it through), not the node store: that check is
what makes the read safe, since bytes reached through a link swapped in since the
save differ from what the save wrote and are refused as damage is.
Ranks report through the c10d store, as the async commit does (no collective,
no call from the training loop); the coordinator then copies the index objects,
checks with one listing that every object the manifest names arrived, and writes
the very manifest the local tier holds, create-only, then ``.metadata``
(:func:`~objckpt.ops.maintain.verify.commit_copy`, as ``objckpt cp`` commits). Until that
PUT, nothing of the step is visible on the primary: a
promotion killed half-way leaves the previous durable step as the newest and
objects ``objckpt gc`` removes, while the local tier still holds the new step.

Each rank's cost is its own bytes plus a constant number of store keys; the
coordinator alone reads W keys, as it does for every async commit.

What a promotion worker runs (one object copied and checked) is
:func:`~objckpt.ops.maintain.object_check.promote_object`: a worker imports the
module that holds the function it runs, and this one imports torch (the rank
exchange); that one does not, so a promotion worker stays a torch-free interpreter
like the upload workers (seconds of CPU and ~190 MiB less per rank).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from objckpt._torch import group_store
from objckpt.errors import CheckpointExistsError, UploadError
from objckpt.format.layout import is_objckpt_payload
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepPlaces
from objckpt.ops.maintain.object_check import promote_object
from objckpt.ops.maintain.verify import commit_copy
from objckpt.options import UploadOptions
from objckpt.pipeline.finalize import RankExchange
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers import open_store
from objckpt.writers.accounting import RequestStats
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

__all__ = ["Promoter"]

logger = logging.getLogger(__name__)


class Promoter:
    """Promotes local steps of one rank, one step at a time, in order.

    Each step arrives with its directories (a :class:`~objckpt.format.steps.StepPlaces`:
    ``local`` is copied to ``root``), so the promoter derives none.

    Args:
        submit: Runs a function in a promotion worker process (``WorkerPool.submit``).
        upload: Part sizing for the copies.
        rank, world, process_group: Who promotes together (``process_group`` None
            and ``world`` 1: a single process).
        timeout: Seconds the coordinator waits for every rank's report.
        on_durable: Coordinator: called with (places, manifest) once the primary's
            manifest is committed.
    """

    def __init__(
        self,
        *,
        submit: Callable[..., concurrent.futures.Future[Any]],
        upload: UploadOptions,
        rank: int,
        world: int,
        process_group: Any | None,
        distributed: bool,
        timeout: float,
        on_durable: Callable[[StepPlaces, Manifest], None] | None = None,
    ) -> None:
        self._submit = submit
        self._upload = upload
        self._rank = rank
        self._world = world
        self._group = process_group
        self._distributed = distributed
        self._timeout = timeout
        self._on_durable = on_durable
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-promote")
        self._lock = threading.Lock()
        self._running: dict[int, concurrent.futures.Future[None]] = {}

    def submit(self, places: StepPlaces, handle: SaveHandle) -> concurrent.futures.Future[None]:
        """Promote ``places.step`` once its local save (``handle``) has committed."""
        with self._lock:
            fut = self._pool.submit(self._promote, places, handle)
            self._running[places.step] = fut
        fut.add_done_callback(lambda f: self._done(places, f))
        return fut

    def _done(self, places: StepPlaces, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._running.pop(places.step, None)
        exc = fut.exception()
        if exc is not None:
            logger.error("promotion of step %d to %s failed: %s", places.step, places.root.url, exc)

    def running(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._running))

    def _promote(self, places: StepPlaces, handle: SaveHandle) -> None:
        started = time.monotonic()
        step, src, dst = places.step, places.local, places.root
        assert src is not None  # a local step
        manifest = handle.result()  # committed locally (the coordinator's copy)
        error: BaseException | None = None
        stats = RequestStats()
        try:
            futures = [
                self._submit(promote_object, src, dst, self._upload, e) for e in handle.written
            ]
            for f in futures:
                stats = stats + f.result()
        except BaseException as exc:
            error = exc
        if not self._distributed:
            if error is not None:
                raise error
            assert manifest is not None
            self._commit(places, src, manifest)
        else:
            self._agree(places, handle, src, manifest, error)
        logger.info(
            "step %d promoted to %s in %.2f s (this rank: %d objects, %s)",
            step,
            dst.url,
            time.monotonic() - started,
            len(handle.written),
            stats.summary(),
        )

    def _agree(
        self,
        places: StepPlaces,
        handle: SaveHandle,
        src: Location,
        manifest: Manifest | None,
        error: BaseException | None,
    ) -> None:
        exchange = RankExchange(
            group_store(self._group),
            f"promote-{handle.attempt}",
            self._rank,
            self._world,
            self._timeout,
            f"{places.root.url} (promotion from the local tier)",
        )
        exchange.post(error is None, None if error is None else describe(error))
        if self._rank != 0:
            if error is not None:
                raise error
            outcome = exchange.outcome()
            if outcome is not None:
                raise UploadError(outcome)
            return
        try:
            exchange.gather()
            assert manifest is not None
            self._commit(places, src, manifest)
        except BaseException as exc:
            exchange.publish_outcome(describe(exc))
            raise
        exchange.publish_outcome(None)

    def _commit(self, places: StepPlaces, src: Location, manifest: Manifest) -> None:
        """Coordinator: the index objects (W of them, 16 at a time), one listing that
        every object the manifest names is on the primary (the ranks copied the
        payload; a ``gc`` with a short grace may have deleted some since), the
        manifest create-only, then ``.metadata`` (a fixed name: written before the
        commit it would change an already committed root step's)."""
        index = tuple(e for e in manifest.objects if not is_objckpt_payload(e.key))
        src_store, dst_store = open_store(src), open_store(places.root, self._upload)
        try:
            commit_copy(
                src_store, dst_store, manifest, None, min(16, len(index)), False, objects=index
            )
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"{exc}; the local step {places.step} was not promoted ({src.url} keeps it)"
            ) from exc
        finally:
            src_store.close()
            dst_store.close()
        if self._on_durable is not None:
            self._on_durable(places, manifest)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the promotions submitted so far (errors stay with their handles)."""
        with self._lock:
            futures = list(self._running.values())
        concurrent.futures.wait(futures, timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
