"""``DeferredWriter``: the DCP writer of an async save, which queues instead of uploading.

DCP's ``dcp.save`` runs plan -> write -> finish on the caller's thread and expects
``write_data`` to return the bytes' locations. An async save cannot wait for the
uploads there, so this writer hands each payload object to the upload workers,
returns placeholder results (the real ones travel through the c10d store later,
see :mod:`objckpt.pipeline.finalize`), and keeps the global plan
(:class:`~objckpt.format.commit.GlobalPlan`) for the commit that the background
thread makes.

It wraps an :class:`~objckpt.ObjectStoreWriter` rather than subclassing it: the
plain writer keeps its one job (a synchronous save) and the pieces an async save
shares with it — location, options, the store, the attempt id — are reached
through its public surface (``attach``, ``location``, ``store``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from objckpt.dcp.plan import ObjectPlan, RankPlan, assign_objects, estimate_size
from objckpt.dcp.serialize import Framer, PayloadRecord, resolve_bytes_items, serialized_tensor
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import ConfigurationError, InternalError, StateDictError, UploadError
from objckpt.format.commit import GlobalPlan
from objckpt.format.layout import payload_key
from objckpt.pipeline.segment import aligned
from objckpt.pipeline.stage import Staged, Wave
from objckpt.pipeline.target_check import CheckGate
from objckpt.pipeline.upload_task import FramedRef, SegmentRef, upload_object
from objckpt.pipeline.workers import WEDGED_AFTER, WorkerPool
from objckpt.writers.deadline import Deadline

__all__ = ["DeferredWriter", "Pending"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pending:
    """One payload object handed to the workers, and its upload's future."""

    obj: ObjectPlan
    future: concurrent.futures.Future[PayloadRecord]


class DeferredWriter(StorageWriter):
    """A DCP writer whose ``write_data`` queues uploads and whose ``finish`` defers the commit.

    Args:
        target: The plain writer for the target URL (already ``attach``-ed to the
            agreed attempt and any shared filesystem); kept as :attr:`target`.
        pool: The upload workers.
        staged: The staged copy of the state dict the items resolve to.
        framer: Tensor frames, kept by the checkpointer across saves.
    """

    def __init__(
        self, target: ObjectStoreWriter, pool: WorkerPool, staged: Staged, framer: Framer
    ) -> None:
        super().__init__()
        #: The plain writer of the target URL: location, options, store, attempt id.
        self.target = target
        self._pool = pool
        self._staged = staged
        self._framer = framer
        self.pending: list[Pending] = []
        self.items: list[Any] = []
        self.rank_plan: RankPlan | None = None
        #: The global plan (coordinator only): DCP's metadata, for the commit.
        self.global_plan: GlobalPlan | None = None
        self.final_plan: SavePlan | None = None
        #: Bounds this save's requests, in the workers and at the commit.
        self.deadline: Deadline | None = None
        #: Whether every tensor item resolved into a staging segment (so a later
        #: save of this structure may queue its uploads after ``save()`` returns).
        self.all_staged = True
        #: Whether the plan has non-tensor items (set when it is queued).
        self.has_bytes = True
        self._deferred: Callable[[], None] | None = None
        #: Rank 0's answer to "already committed?", which this save's uploads wait
        #: for (:meth:`hold_uploads`; None: they need not).
        self.gate: CheckGate | None = None
        self._held: list[tuple[ObjectPlan, tuple[Any, ...]]] | None = None

    # -- DCP protocol: delegated to the plain writer ------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self.target.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.target.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> StorageMeta | None:
        return self.target.storage_meta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # the target was checked before planning (save_phases, target_check)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.target.attempt is None:
            raise InternalError("internal: global plan before the attempt was agreed")
        return self.target.prepare_global_plan(plans)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return ObjectStoreWriter.validate_checkpoint_id(checkpoint_id)

    # -- queueing -------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._queue_after(plan, planner, later=False)
        # DCP gathers these now; the real locations travel through the c10d store later.
        placeholders = [
            WriteResult(index=i.index, size_in_bytes=estimate_size(i), storage_data=None)
            for i in self.items
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(placeholders)
        return fut

    def _queue_after(
        self,
        plan: SavePlan,
        planner: SavePlanner,
        *,
        later: bool,
        set_up: Callable[[], None] | None = None,
        has_bytes: bool | None = None,
    ) -> None:
        """Hand the plan's payload objects to the workers, now or (``later``) when
        :meth:`queue_deferred` runs on the commit thread.

        Only what reads the caller's objects must happen before ``save()`` returns:
        the non-tensor entries are serialized now (``set_up`` readies the planner
        for that). Tensor items resolve to staged copies this checkpointer owns, so
        framing them and submitting their uploads can wait — when the caller says so,
        having seen every tensor of this structure resolve into a segment.
        """
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, RankPlan):
            raise ConfigurationError("write_data got a plan this writer did not prepare")
        self.rank_plan = rank_plan
        self.final_plan = plan
        self.items = list(plan.items)
        upload = self.target.upload
        self.deadline = Deadline.start(
            upload.deadline, f"rank {rank_plan.rank} saving {self.target.location.url}"
        )
        if has_bytes is None:  # a replay knows it from the cached plan
            has_bytes = any(i.type == WriteItemType.BYTE_IO for i in self.items)
        self.has_bytes = has_bytes
        later = later and self._staged.wave is None
        if set_up is not None and (has_bytes or not later):
            set_up()
            set_up = None
        # Fails here, before any upload, and reads the caller's objects: never deferred.
        resolved = resolve_bytes_items(self.items, planner) if has_bytes else {}

        def queue() -> None:
            if self._staged.copy is not None:
                self._staged.copy.run()  # background staging: the copy comes first
            if set_up is not None:
                set_up()
            self._queue(rank_plan, planner, resolved, strict=later)

        if later:
            self._deferred = queue
        else:
            queue()

    def queue_deferred(self) -> BaseException | None:
        """On the commit thread: queue what :meth:`_queue_after` deferred; its error, if any."""
        queue, self._deferred = self._deferred, None
        if queue is None:
            return None
        try:
            queue()
        except BaseException as exc:  # reported as the save's error, after settling
            return exc
        return None

    def _queue(
        self,
        rank_plan: RankPlan,
        planner: SavePlanner,
        resolved: dict[int, Any],
        *,
        strict: bool,
    ) -> None:
        upload = self.target.upload
        # The workers share the rank's request budget (and so its part-buffer memory,
        # max_parts_in_flight * part_size), as one synchronous writer would hold it.
        share = -(-upload.max_parts_in_flight // self._pool.workers)
        per_worker = dataclasses.replace(upload, max_parts_in_flight=share)
        location = self.target.location
        items = self.items
        position = {id(item): n for n, item in enumerate(items)}
        staged = self._staged
        wave = staged.wave
        # In waves, no packed object may be larger than a wave, counted as the wave
        # counts (each view aligned).
        object_size = upload.object_size
        if wave is not None:
            object_size = min(object_size, wave.capacity)
        objects = assign_objects(
            items,
            object_size,
            lambda i: payload_key(
                rank_plan.rank,
                i,
                rank_plan.attempt,
                upload.prefix_entropy,
                upload.persistent_prefixes,
            ),
            footprint=None if wave is None else aligned,
        )
        base = self.target.base_table(items) if objects else None
        this_wave: list[concurrent.futures.Future[PayloadRecord]] = []
        if wave is not None and objects:
            refusal = self.pass_gate()  # a wave's uploads cannot be held: ask first
            if refusal is not None:
                raise refusal
        for obj in objects:
            values: list[tuple[int, torch.Tensor | bytes]] = []
            for item in obj.items:
                pos = position[id(item)]
                if item.type == WriteItemType.BYTE_IO:
                    values.append((pos, resolved[pos].getvalue()))
                    continue
                tensor = planner.resolve_data(item)
                if not isinstance(tensor, torch.Tensor):
                    raise StateDictError(
                        f"entry {item.index.fqn!r} was planned as a tensor but is "
                        f"{type(tensor).__name__}"
                    )
                values.append((pos, tensor))
            if wave is not None:
                entries = self._into_wave(wave, values, this_wave, staged.cuda)
            else:
                entries = [(pos, self._entry(v, staged.ref_of, strict)) for pos, v in values]
            reuse = base.for_items((position[id(i)], i) for i in obj.items) if base else None
            task = (location, per_worker, obj.key, entries, self.deadline, reuse or None)
            if self._held is not None:  # until rank 0 answers "already committed?"
                self._held.append((obj, task))
            else:
                this_wave.append(self._submit(obj, task))

    def _submit(
        self, obj: ObjectPlan, task: tuple[Any, ...]
    ) -> concurrent.futures.Future[PayloadRecord]:
        future = self._pool.submit(upload_object, *task)
        self.pending.append(Pending(obj, future))
        return future

    def hold_uploads(self, gate: CheckGate) -> None:
        """Keep the uploads queued from now on from the workers until
        :meth:`pass_gate`: rank 0 has not answered "already committed?" yet
        (:mod:`objckpt.pipeline.target_check`). Staged in waves, whose memory is
        reused once a wave is uploaded, the first upload waits for the answer instead."""
        self.gate = gate
        self._held = [] if self._staged.wave is None else None

    def pass_gate(self) -> BaseException | None:
        """Rank 0's refusal, or None (also without a gate); the held uploads go to
        the workers, or are dropped on a refusal (nothing of the save is uploaded)."""
        if self.gate is None:
            return None
        refusal = self.gate.answer(self.deadline)
        held, self._held = self._held or [], None
        for obj, task in [] if refusal is not None else held:
            self._submit(obj, task)
        return refusal

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Committed later, by the background thread; each rank's placeholders name the
        # items the plan gave it, which the manifest's writer columns come from.
        self.global_plan = GlobalPlan(metadata, results)

    def replay(
        self,
        plan: SavePlan,
        planner: SavePlanner,
        global_plan: GlobalPlan | None,
        *,
        set_up: Callable[[], None],
        later: bool,
        has_bytes: bool,
    ) -> None:
        """Queue the uploads of a cached final plan (the structure is unchanged).

        ``global_plan`` is the cached global plan (None on ranks other than the
        coordinator, which never see it). ``set_up`` readies ``planner`` on the new
        staged state; with ``later`` both it and the queueing may wait for
        :meth:`queue_deferred` (see :meth:`_queue_after`)."""
        attempt = self.target.attempt
        if attempt is None:
            raise InternalError("internal: replay before the attempt was agreed")
        rank_plan = RankPlan(rank=self.target.rank, attempt=attempt)
        plan = dataclasses.replace(plan, storage_data=rank_plan)
        self._queue_after(plan, planner, later=later, set_up=set_up, has_bytes=has_bytes)
        self.global_plan = global_plan

    def settle(self) -> None:
        """Wait for every queued upload to end, whatever its outcome."""
        for p in self.pending:
            p.future.exception()

    def _entry(
        self,
        value: torch.Tensor | bytes,
        ref_of: Callable[[torch.Tensor], SegmentRef | None],
        strict: bool = False,
    ) -> FramedRef | bytes:
        """What a worker gets for one item: a staged tensor as its frame and the place
        of its bytes (the worker copies them from the segment); anything else as the
        bytes DCP stores (serialized here, as a tensor that is not in a segment must be).

        ``strict`` (queueing after ``save()`` returned): a tensor outside the staging
        segments would be the caller's memory, read after they may have changed it.
        """
        if not isinstance(value, torch.Tensor):
            return value
        if not self._staged.owns(value):
            if strict:
                raise InternalError(
                    f"internal: a {tuple(value.shape)} tensor of {self.target.location.url} "
                    "is not in staging memory while queueing after save() returned"
                )
            self.all_staged = False
        frame = self._framer.frame(value)
        ref = ref_of(value) if frame is not None else None
        if frame is None or ref is None:
            return serialized_tensor(value, self._framer)
        return FramedRef(frame[0], ref, frame[1])

    def _drain_wave(self, this_wave: list[concurrent.futures.Future[PayloadRecord]]) -> None:
        """Wait for a full wave's uploads before its memory is reused, bounded as the
        commit thread's wait is: until the save's deadline plus ``WEDGED_AFTER``, after
        which the uploads still outstanding are held by a wedged worker, which is
        killed (a live one fails its requests at the deadline)."""
        deadline = self.deadline
        timeout = None if deadline is None else max(0.0, deadline.remaining() + WEDGED_AFTER)
        _, outstanding = concurrent.futures.wait(this_wave, timeout=timeout)
        if outstanding and deadline is not None:
            self._pool.terminate(outstanding, f"{deadline.who}: no answer past the deadline")
            raise deadline.error(
                f"a staging wave's {len(outstanding)} upload(s) had no answer from the upload "
                f"workers {WEDGED_AFTER:g} s past the deadline (they were stopped)"
            )
        for f in this_wave:
            try:
                f.result()
            except BrokenProcessPool as exc:
                raise UploadError(
                    f"an upload worker died while saving {self.target.location.url} in "
                    "staging waves (killed or out of memory); nothing was committed"
                ) from exc

    def _into_wave(
        self,
        wave: Wave,
        entries: list[tuple[int, torch.Tensor | bytes]],
        this_wave: list[concurrent.futures.Future[PayloadRecord]],
        cuda: bool,
    ) -> list[tuple[int, FramedRef | bytes]]:
        """Copy one object's tensors into the wave segment, first draining a full wave."""
        tensors = [v for _, v in entries if isinstance(v, torch.Tensor)]
        if not wave.fits_all(tensors):
            logger.debug("staging wave full (%d bytes); waiting for its uploads", wave.used)
            self._drain_wave(this_wave)
            this_wave.clear()
            wave.reset()
        out = [(pos, self._entry(v, wave.put)) for pos, v in entries]
        wave.sync(cuda)
        return out
