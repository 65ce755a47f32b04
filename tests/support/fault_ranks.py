"""Rank bodies of the fault matrix (module-level so spawn can import them).

One job of W gloo ranks walks every cell of one column (sync saves, async saves or
loads) in order: a fault is injected on exactly one rank, every rank runs the same
operation, and each rank writes what happened to it (outcome, error type, seconds)
to ``<out>/<cell>.rank<r>.json``. After each faulty cell the job saves (or loads)
again with no fault: that must succeed on every rank. The parent test reads the
files; a rank that hung leaves no file for its cell.

The proxy's rules for store faults are set by the parent before the job starts,
keyed by the cell's URL (``/<cell>/``), so a rule breaks only its own cell.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import SHORT_WINDOW
from ranks import init_ranks
from simulated_room import simulated_room

import objckpt
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.save_phases import TargetCache
from objckpt.writers.clients import ClientCache
from objckpt.writers.location import Location

#: (cell, faulty rank) per column, in the order the job walks them.
ASYNC_CELLS = [
    ("refused-value", 1),
    ("staging-no-room", 2),
    ("fs-open-fails", 3),
    ("replay-fails", 0),
    ("replay-fails-r2", 2),
    ("planning-fails", 1),
    ("upload-fails", 2),
    ("upload-late", 2),
    ("index-put-fails", 0),
    ("worker-killed", 3),
    ("commit-fails", 0),
    ("on-commit-raises", 0),
]
SYNC_CELLS = [
    ("refused-value", 1),
    ("fs-open-fails", 3),
    ("planning-fails", 1),
    ("upload-fails", 2),
    ("index-put-fails", 0),
    ("commit-fails", 0),
]
LOAD_CELLS = [
    ("fs-open-fails", 2),
    ("refused-value", 1),
    ("payload-get-fails", 3),
]
MANAGER_CELLS = [
    ("ctor-bad-backup", 1),
    ("ctor-start-fails", 2),
    ("load-falls-back", 3),
]
#: A local tier with replicas, 4 ranks as 2 nodes: a replication that fails on one
#: rank never fails the save; every rank reports the step not replicated.
REPLICATION_CELLS = [
    ("replication-raises", 1),
    ("peer-disk-full", 3),
    ("index-write-fails", 3),
    ("replica-bit-flipped", 3),
    ("replicas-dir-a-link", 2),
]
#: Cells whose fault must not fail the operation (the save committed; the load
#: fell back to the backup on every rank; the step stayed committed locally).
SUCCEEDS = {
    "on-commit-raises",
    "load-falls-back",
    "replication-raises",
    "peer-disk-full",
    "index-write-fails",
    "replica-bit-flipped",
    "replicas-dir-a-link",
}
DEADLINE = 20.0
BARRIER = 15.0
#: A refusal that lasts ends its request in seconds (``give_up_after``), not in the
#: default 60 s window: the refusal cells (``upload-fails``, ``index-put-fails``,
#: ``commit-fails``) test that every rank ends the same way when one rank's request is
#: refused, not how long the window is (tests/store/test_persistent_errors.py does).
#: ``upload-late`` keeps the path the refusals took under the default window: a rank
#: alive but still uploading when rank 0's ``barrier_timeout`` ends, which reports
#: after rank 0 gave up on it.
RETRY = SHORT_WINDOW
#: How long ``upload-late`` holds rank 2's payload writes: past rank 0's wait for the
#: reports (``BARRIER`` from its own), within the save's deadline.
LATE = BARRIER + 4


def everything(world: int) -> dict[str, torch.Tensor]:
    """Every rank's tensors: what a load of a job's checkpoint gives back."""
    return {k: v for r in range(world) for k, v in _state(r).items()}


def _state(rank: int, extra: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    state: dict[str, Any] = {f"r{rank}.w{i}": torch.randn(64, 64, generator=g) for i in range(3)}
    if extra:
        state[f"r{rank}.extra"] = torch.ones(8)
    return state


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _raiser(exc: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


def _record(out: str, cell: str, rank: int, fn: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        fn()
        outcome, kind, text = "ok", "", ""
    except BaseException as exc:  # CheckpointException is a BaseException
        outcome, kind, text = "error", type(exc).__name__, str(exc)[:300]
    with open(os.path.join(out, f"{cell}.rank{rank}.json"), "w") as f:
        json.dump(
            {
                "outcome": outcome,
                "type": kind,
                "error": text,
                "seconds": time.monotonic() - started,
            },
            f,
        )


def _fault(cell: str, mine: bool, ckpt: Any = None) -> contextlib.AbstractContextManager[None]:
    """The injection of ``cell`` on this rank (a no-op on the healthy ranks and for the
    cells the proxy breaks)."""
    if not mine:
        return contextlib.nullcontext()
    if cell == "staging-no-room":
        # This rank's staging directory is full: no idle set to reuse, and a reservation
        # for a new one (the whole state dict, then one wave) meets ENOSPC.
        ckpt._stager.free_idle()
        return simulated_room(ckpt._stager.directory, 0)
    if cell == "fs-open-fails":
        down = objckpt.errors.StoreUnreachableError("cannot open the filesystem (injected)")
        if ckpt is not None:
            return _patched(TargetCache, "attach", _raiser(down))
        # Every filesystem this rank opens from now on fails: a new client
        # (Location.open_fs) and this process's shared one (ClientCache), which
        # may already hold a client from an earlier operation.
        stack = contextlib.ExitStack()
        stack.enter_context(_patched(Location, "open_fs", _raiser(down)))
        stack.enter_context(_patched(ClientCache, "filesystem", _raiser(down)))
        return stack
    if cell.startswith("replay-fails"):
        return _patched(DeferredWriter, "replay", _raiser(RuntimeError("replay (injected)")))
    if cell == "planning-fails":
        # The async path plans through its deferred writer (the target's own
        # prepare_local_plan is the target check there).
        cls = DeferredWriter if ckpt is not None else objckpt.ObjectStoreWriter
        return _patched(cls, "prepare_local_plan", _raiser(RuntimeError("planning (injected)")))
    if cell == "worker-killed":
        for pid in ckpt.worker_pids:
            os.kill(pid, signal.SIGKILL)
    return contextlib.nullcontext()


def async_column(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    init_ranks(rank, world, init_file)
    failing_hook = {"on": False}

    def on_commit(url: str, manifest: Any) -> None:
        if failing_hook["on"]:
            raise RuntimeError("on-commit hook (injected)")

    try:
        upload = objckpt.UploadOptions(deadline=DEADLINE)
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=BARRIER)
        with objckpt.AsyncCheckpointer(
            storage_options=options,
            upload=upload,
            retry=RETRY,
            async_options=opts,
            on_commit=on_commit,
        ) as ckpt:
            ckpt.save(_state(rank), f"{root}/warmup").result(timeout=120)
            for cell, faulty in ASYNC_CELLS:
                mine = rank == faulty
                state = _state(rank, extra=cell == "planning-fails")
                if cell == "refused-value" and mine:
                    state["sparse"] = torch.eye(4).to_sparse()
                failing_hook["on"] = cell == "on-commit-raises" and mine

                def save(cell: str = cell, mine: bool = mine, state: Any = state) -> None:
                    with _fault(cell, mine, ckpt):
                        handle = ckpt.save(state, f"{root}/{cell}")
                    handle.result(timeout=DEADLINE + BARRIER * 3 + 30)

                _record(out, cell, rank, save)
                failing_hook["on"] = False
                _record(
                    out,
                    f"{cell}.after",
                    rank,
                    lambda cell=cell: ckpt.save(_state(rank), f"{root}/{cell}-after").result(
                        timeout=120
                    ),
                )
    finally:
        dist.destroy_process_group()


def sync_column(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    init_ranks(rank, world, init_file)
    upload = objckpt.UploadOptions(deadline=DEADLINE)

    def save(url: str, state: dict[str, Any]) -> None:
        dcp.save(
            state,
            storage_writer=objckpt.ObjectStoreWriter(
                url, storage_options=options, upload=upload, retry=RETRY
            ),
        )

    try:
        save(f"{root}/warmup", _state(rank))
        for cell, faulty in SYNC_CELLS:
            mine = rank == faulty
            state = _state(rank)
            if cell == "refused-value" and mine:
                state["sparse"] = torch.eye(4).to_sparse()

            def run(cell: str = cell, mine: bool = mine, state: Any = state) -> None:
                with _fault(cell, mine):
                    save(f"{root}/{cell}", state)

            _record(out, cell, rank, run)
            _record(
                out, f"{cell}.after", rank, lambda c=cell: save(f"{root}/{c}-after", _state(rank))
            )
    finally:
        dist.destroy_process_group()


def load_column(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    init_ranks(rank, world, init_file)
    expected = everything(world)

    def load(url: str, target: dict[str, Any]) -> None:
        reader = objckpt.ObjectStoreReader(url, storage_options=options, retry=RETRY)
        dcp.load(target, storage_reader=reader)
        for k, v in target.items():
            if not torch.equal(v, expected[k]):
                raise AssertionError(f"{k} loaded wrong bytes")

    try:
        for cell in [c for c, _ in LOAD_CELLS]:  # written with no fault
            dcp.save(
                _state(rank),
                storage_writer=objckpt.ObjectStoreWriter(f"{root}/{cell}", storage_options=options),
            )
        for cell, faulty in LOAD_CELLS:
            mine = rank == faulty
            target = {k: torch.zeros_like(v) for k, v in expected.items()}
            if cell == "refused-value" and mine:
                target["r0.w0"] = torch.zeros(3, 3)  # a shape the checkpoint does not have

            def run(cell: str = cell, mine: bool = mine, target: Any = target) -> None:
                with _fault(cell, mine):
                    load(f"{root}/{cell}", target)

            _record(out, cell, rank, run)
            after = {k: torch.zeros_like(v) for k, v in expected.items()}
            _record(out, f"{cell}.after", rank, lambda t=after: load(f"{root}/base", t))
    finally:
        dist.destroy_process_group()


def manager_sparse_on_one_rank(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    """The reported case: rank 1's state holds a sparse tensor at step 1. Every rank
    must fail step 1, then commit step 2, and agree on the steps."""
    init_ranks(rank, world, init_file)
    try:
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=BARRIER)
        with objckpt.CheckpointManager(root, storage_options=options, async_options=opts) as mgr:
            state = _state(rank)
            if rank == 1:
                state["sparse"] = torch.eye(4).to_sparse()

            def step1() -> None:
                mgr.save(1, state).result(timeout=120)

            _record(out, "step1", rank, step1)
            _record(out, "step2", rank, lambda: mgr.save(2, _state(rank)).result(timeout=120))
            with open(os.path.join(out, f"steps.rank{rank}.json"), "w") as f:
                json.dump(mgr.all_steps(), f)
    finally:
        dist.destroy_process_group()


def collectives_without_cpu_backend(rank: int, world: int, init_file: str) -> None:
    """``cuda:gloo`` refuses CPU tensors as NCCL does: objckpt's collectives still work."""
    from objckpt.dcp.collective import Collectives
    from objckpt.pipeline.plan_cache import agree

    dist.init_process_group(
        "cuda:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            assert "cpu" in str(exc).lower(), exc
        else:
            raise AssertionError("cuda:gloo took a CPU tensor: the test proves nothing")
        collectives = Collectives()
        r = collectives.route()
        assert r.side_group or r.device.type == "cuda", r
        assert collectives.route().group is r.group  # its side group, built once
        assert collectives.all_reduce_max([rank, -rank]) == [world - 1, 0]
        got = collectives.all_gather_object({"rank": rank, "steps": frozenset({rank})})
        assert got == [{"rank": r, "steps": frozenset({r})} for r in range(world)], got
        assert collectives.broadcast_object({"from": rank}, 1) == {"from": 1}
        buf = bytearray(b"abc" if rank == 0 else 3)
        collectives.broadcast_bytes(buf, 0)
        assert bytes(buf) == b"abc"
        assert collectives.any_rank(rank == world - 1)
        assert collectives.from_rank0(lambda: "decided") == "decided"
        assert collectives.gather_object(rank) == (list(range(world)) if rank == 0 else None)
        agreement = agree(True, rank == 1, rank, collectives, True, sequence=3)
        assert agreement.refused_by == 1 and agreement.hit
    finally:
        dist.destroy_process_group()


def saves_out_of_step(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    """Rank 1 has counted one save() more than rank 0 (as if it made a call rank 0 did
    not): that save fails on both ranks naming the numbers, and the next one commits."""
    init_ranks(rank, world, init_file)
    try:
        with objckpt.AsyncCheckpointer(async_options=objckpt.AsyncOptions(workers=1)) as ckpt:
            ckpt.save(_state(rank), f"{root}/one").result(timeout=120)
            if rank == 1:
                ckpt._sequence += 1
            _record(out, "skewed", rank, lambda: ckpt.save(_state(rank), f"{root}/two").result())
            _record(out, "next", rank, lambda: ckpt.save(_state(rank), f"{root}/three").result(120))
    finally:
        dist.destroy_process_group()


def manager_column(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    """CheckpointManager: a constructor that fails on one rank (an option only that
    rank got wrong, a failure starting its save path), and a load whose primary
    fails on one rank (every rank falls back to the backup together)."""
    from objckpt.ops.run import manager as manager_module

    init_ranks(rank, world, init_file)
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=BARRIER)
    upload = objckpt.UploadOptions(deadline=DEADLINE)
    kw: dict[str, Any] = {
        "storage_options": options,
        "async_options": opts,
        "upload": upload,
        "retry": RETRY,
    }

    def save_and_load(url: str, step: int) -> None:
        with objckpt.CheckpointManager(url, **kw) as mgr:
            mgr.save(step, _state(rank)).result(timeout=120)
            got = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
            assert mgr.load(got, step) == step
            assert all(torch.equal(got[k], v) for k, v in _state(rank).items())

    try:
        backups = ["nope9://bucket/x"] if rank == 1 else []
        _record(
            out,
            "ctor-bad-backup",
            rank,
            lambda: objckpt.CheckpointManager(f"{root}/ctor-bad-backup", backups=backups, **kw),
        )
        _record(out, "ctor-bad-backup.after", rank, lambda: save_and_load(f"{root}/c1", 1))
        failing = _raiser(RuntimeError("starting the save path (injected)"))
        fault = _patched(manager_module, "SaveFlow", failing)
        with fault if rank == 2 else contextlib.nullcontext():
            _record(
                out,
                "ctor-start-fails",
                rank,
                lambda: objckpt.CheckpointManager(f"{root}/ctor-start-fails", **kw),
            )
        _record(out, "ctor-start-fails.after", rank, lambda: save_and_load(f"{root}/c2", 1))
        # Step 1 committed on the primary and copied to the backup; the proxy then
        # fails rank 3's payload GETs on the primary for good.
        url = f"{root}/load-falls-back"
        with objckpt.CheckpointManager(url, backups=[f"{root}/backup"], **kw) as mgr:
            mgr.save(1, _state(rank)).result(timeout=120)
            mgr.wait_until_finished()
            got = {k: torch.zeros_like(v) for k, v in _state(rank).items()}

            def load() -> None:
                assert mgr.load(got, 1) == 1
                assert all(torch.equal(got[k], v) for k, v in _state(rank).items())

            _record(out, "load-falls-back", rank, load)
            _record(out, "load-falls-back.after", rank, lambda: save_and_load(f"{root}/c3", 2))
    finally:
        dist.destroy_process_group()


def _flipping(write: Callable[..., Any]) -> Callable[..., Any]:
    def flipped(self: Any, i: int, data: memoryview) -> None:
        changed = bytearray(data)
        changed[0] ^= 1
        write(self, i, memoryview(changed))

    return flipped


@contextlib.contextmanager
def _replicas_linked(node: str) -> Iterator[None]:
    """``<node>/replicas`` replaced by a link to a directory outside the tier (set up
    before this rank's save, so before any exchange of the step); put back after."""
    replicas, outside = os.path.join(node, "replicas"), node + "-outside"
    os.makedirs(outside, exist_ok=True)
    kept = replicas + ".kept"
    os.rename(replicas, kept)
    os.symlink(outside, replicas)
    try:
        yield
    finally:
        os.unlink(replicas)
        os.rename(kept, replicas)
        assert not os.listdir(outside), os.listdir(outside)  # nothing written through


def replication_column(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    """Local saves replicated across 2 nodes of 2 ranks (torchrun's environment per
    rank): one rank's replication raises (it cannot list its files), a peer's disk is
    full for replicas, one rank cannot write its index object to its disk. Each save
    must commit on every rank with the step reported not replicated on every rank,
    naming the failing rank; the next save replicates."""
    from lost_node_ranks import _full_under

    from objckpt.ops.tier.peers import _Incoming
    from objckpt.ops.tier.replication import PeerReplicator

    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    init_ranks(rank, world, init_file)
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=BARRIER)
    tier = objckpt.LocalTier(
        os.path.join(out, "tier", f"node{rank // 2}"),
        retention=objckpt.RetentionPolicy(keep_last=2),
        promote_every=100,
        replicas=2,
        replication_timeout=BARRIER,
    )
    faults = {
        "replication-raises": lambda: _patched(
            PeerReplicator, "_own_files", _raiser(RuntimeError("listing (injected)"))
        ),
        # Through open and through the node store's files (how replicas are received).
        "peer-disk-full": lambda: _full_under("/replicas/"),
        "index-write-fails": lambda: _full_under("/.__index_"),
        # One bit of what rank 3 receives flips on the way: its CRC32C against the
        # manifest's value refuses it.
        "replica-bit-flipped": lambda: _patched(_Incoming, "write", _flipping(_Incoming.write)),
        # Node 1's replicas directory is a link out of the tier: never written through.
        "replicas-dir-a-link": lambda: _replicas_linked(os.path.join(out, "tier", "node1")),
    }
    try:
        with objckpt.CheckpointManager(
            f"{root}/replication", storage_options=options, async_options=opts, local=tier
        ) as mgr:
            step = 0
            for cell, faulty in REPLICATION_CELLS:
                step += 1

                def save(cell: str = cell, faulty: int = faulty, step: int = step) -> None:
                    fault = faults[cell]() if rank == faulty else contextlib.nullcontext()
                    with fault:
                        handle = mgr.save(step, _state(rank))
                        handle.result(timeout=DEADLINE + BARRIER * 3 + 30)
                        replicated = handle.wait_replicated(timeout=BARRIER * 4)
                    status = mgr.tier_status()
                    assert replicated is False and step in status.not_replicated, status
                    assert f"rank {faulty}" in (status.replication_error or ""), status

                _record(out, cell, rank, save)
                step += 1

                def after(step: int = step) -> None:
                    assert mgr.save(step, _state(rank)).wait_replicated(timeout=120)

                _record(out, f"{cell}.after", rank, after)
    finally:
        dist.destroy_process_group()
