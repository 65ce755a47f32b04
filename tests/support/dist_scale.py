"""Per-rank bodies for the scale tests (module-level so spawn can import them).

``options`` is the per-run dict the test passes: ``options["store"]`` the storage
options of every rank (or ``options["ranks"][rank]`` per rank), plus whatever the
body needs.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import objckpt
from objckpt._torch import group_store
from objckpt.errors import RequestFailedError
from objckpt.pipeline.finalize import StoreBarrier

MiB = 1024 * 1024
PARTS = objckpt.UploadOptions(part_size=5 * MiB, object_size=64 * MiB)


def replicated_state(mib: int = 64) -> dict[str, torch.Tensor]:
    """``mib`` MiB of fp32 in 16 MiB tensors, the same on every rank (DDP-style)."""
    g = torch.Generator().manual_seed(3)
    return {f"layer{i}.w": torch.randn(1024, 4096, generator=g) for i in range(mib // 16)}


def _options(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    if "ranks" in options:
        return dict(options["ranks"][rank])
    return dict(options["store"])


def _report(options: dict[str, Any], rank: int, doc: Any) -> None:
    with open(f"{options['report']}.rank{rank}", "w") as f:
        json.dump(doc, f)


def save_replicated(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    init_ranks(rank, world, init_file)
    try:
        with objckpt.CheckpointManager(
            url, storage_options=_options(rank, options), upload=PARTS
        ) as mgr:
            mgr.save(1, replicated_state()).result(timeout=240)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def load_replicated(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    init_ranks(rank, world, init_file)
    try:
        expected = replicated_state()
        got = {k: torch.zeros_like(v) for k, v in expected.items()}
        with objckpt.CheckpointManager(url, storage_options=_options(rank, options)) as mgr:
            assert mgr.load(got) == 1
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} differs"
    finally:
        dist.destroy_process_group()


def load_replicated_dcp(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    """A plain ``dcp.load`` of the step with the default reader: the manager's read path."""
    import torch.distributed.checkpoint as dcp

    init_ranks(rank, world, init_file)
    try:
        expected = replicated_state()
        got = {k: torch.zeros_like(v) for k, v in expected.items()}
        reader = objckpt.ObjectStoreReader(url, storage_options=_options(rank, options))
        dcp.load(got, storage_reader=reader)
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} differs"
    finally:
        dist.destroy_process_group()


def hsdp_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(2048, 1024, generator=g),  # 8 MiB
        "emb": torch.randn(1024, 2048, generator=g),  # 8 MiB
        "norm": torch.randn(1536, 1024, generator=g),  # 6 MiB, replicated on both dims
    }


def hsdp_state(mesh: Any) -> dict[str, Any]:
    """2 x 2 (replicate x shard) DTensors plus a fully replicated one."""
    out: dict[str, Any] = {}
    for k, v in hsdp_full().items():
        placements = [Replicate(), Replicate()] if k == "norm" else [Replicate(), Shard(0)]
        out[k] = distribute_tensor(v, mesh, placements)
    return {"model": out, "step": 11}


def save_hsdp(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    init_ranks(rank, world, init_file)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
        with objckpt.CheckpointManager(
            url, storage_options=_options(rank, options), upload=PARTS
        ) as mgr:
            mgr.save(1, hsdp_state(mesh)).result(timeout=240)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def load_hsdp(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    """Load on 4 (the same 2 x 2 mesh) or on 2 (one shard dimension)."""
    init_ranks(rank, world, init_file)
    try:
        if world == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
            state = hsdp_state(mesh)
        else:
            mesh = init_device_mesh("cpu", (world,))
            state = {
                "model": {
                    k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in hsdp_full().items()
                },
                "step": 11,
            }
        for v in state["model"].values():
            v.to_local().zero_()
        state["step"] = 0
        with objckpt.CheckpointManager(url, storage_options=_options(rank, options)) as mgr:
            assert mgr.load(state) == 1
        for k, v in hsdp_full().items():
            assert torch.equal(state["model"][k].full_tensor(), v), f"rank {rank}: {k} differs"
        assert state["step"] == 11
    finally:
        dist.destroy_process_group()


def save_sharded_with_manager(
    rank: int, world: int, init_file: str, url: str, options: dict
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        g = torch.Generator().manual_seed(9)
        state = {"w": distribute_tensor(torch.randn(64, 256, generator=g), mesh, [Shard(0)])}
        with objckpt.CheckpointManager(url, storage_options=_options(rank, options)) as mgr:
            mgr.save(1, state).result(timeout=120)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def load_sharded_with_manager(
    rank: int, world: int, init_file: str, url: str, options: dict
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        g = torch.Generator().manual_seed(9)
        expected = torch.randn(64, 256, generator=g)
        state = {"w": distribute_tensor(torch.zeros(64, 256), mesh, [Shard(0)])}
        with objckpt.CheckpointManager(url, storage_options=_options(rank, options)) as mgr:
            assert mgr.load(state) == 1
        assert torch.equal(state["w"].full_tensor(), expected)
    finally:
        dist.destroy_process_group()


def latest_while_committing(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    """Rank 0 commits step 2 right after the managers are built; rank 1's store is
    slow to list. Both must load the same step, and only rank 0 may list."""
    init_ranks(rank, world, init_file)
    try:
        opts = _options(rank, options)
        with objckpt.CheckpointManager(url, storage_options=opts) as mgr:
            if rank == 0:  # another job commits step 2 (out of band, this process alone)
                writer = objckpt.ObjectStoreWriter(f"{url}/step-0000000002", storage_options=opts)
                state_dict_saver.save(
                    {"w": torch.full((8,), 2.0)}, storage_writer=writer, no_dist=True
                )
            got = {"w": torch.zeros(8)}
            step = mgr.load(got)
        _report(options, rank, {"step": step, "value": float(got["w"][0])})
    finally:
        dist.destroy_process_group()


def failed_request_not_finalized(
    rank: int, world: int, init_file: str, url: str, options: dict
) -> None:
    init_ranks(rank, world, init_file)
    try:
        finalized: list[int] = []
        queue = objckpt.AsyncCallsQueue(barrier=StoreBarrier(), finalize_timeout=60)

        def work(fail: bool) -> None:
            if fail:
                raise ValueError("disk on fire")

        queue.schedule_async_request(
            objckpt.AsyncRequest(work, (rank == 1,), [lambda: finalized.append(0)])
        )
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except RequestFailedError as exc:
            assert rank == 0 and "rank(s) 1" in str(exc), (rank, exc)
        except ValueError as exc:
            assert rank == 1 and "disk on fire" in str(exc), (rank, exc)
        else:
            raise AssertionError(f"rank {rank}: a request that failed on rank 1 was finalized")
        assert finalized == [] and queue.get_num_unfinalized_calls() == 0
        # The queue goes on: the next request succeeds everywhere and is finalized.
        queue.schedule_async_request(
            objckpt.AsyncRequest(work, (False,), [lambda: finalized.append(1)])
        )
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert finalized == [1]
        queue.close()
    finally:
        dist.destroy_process_group()


def two_queues(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    """Queue B's request 0 is still running on rank 1 when queue A's request 0 is
    done everywhere: B must not be finalized on A's arrivals."""
    init_ranks(rank, world, init_file)
    try:
        a = objckpt.AsyncCallsQueue(barrier=StoreBarrier(), finalize_timeout=60)
        b = objckpt.AsyncCallsQueue(barrier=StoreBarrier(), finalize_timeout=60)
        release = threading.Event()
        a.schedule_async_request(objckpt.AsyncRequest(None))
        b.schedule_async_request(
            objckpt.AsyncRequest(release.wait if rank == 1 else None, (60,) if rank == 1 else ())
        )
        assert a.maybe_finalize_async_calls(blocking=True) == [0]
        dist.barrier()
        if rank == 0:
            assert b.maybe_finalize_async_calls(blocking=False) == [], "B saw A's keys"
        dist.barrier()
        release.set()
        assert b.maybe_finalize_async_calls(blocking=True) == [0]
        a.close()
        b.close()
    finally:
        dist.destroy_process_group()


def c10d_keys_over_saves(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    init_ranks(rank, world, init_file)
    try:
        store = group_store(None)
        counts = []
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
        with objckpt.AsyncCheckpointer(
            storage_options=_options(rank, options), async_options=opts
        ) as ckpt:
            for step in range(20):
                state = {"w": torch.full((16,), float(step)), "step": step}
                ckpt.save(state, f"{url}/step-{step}").result(timeout=120)
                dist.barrier()  # every rank has read the outcome before counting
                counts.append(store.num_keys())
                dist.barrier()
        _report(options, rank, counts)
    finally:
        dist.destroy_process_group()
