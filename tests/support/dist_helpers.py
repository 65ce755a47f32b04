"""Per-rank bodies for the distributed tests (module-level so spawn can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return {
        "w": torch.randn(66, 32, generator=g),  # uneven over 4 ranks
        "emb": torch.randn(40, 16, generator=g),
        "b": torch.randn(32, generator=g),
    }


def save_sharded(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 7,
        }
        writer = objckpt.ObjectStoreWriter(url, storage_options=options)
        dcp.save(state, storage_writer=writer)
        if rank == 0:
            assert writer.last_manifest is not None and writer.last_manifest.world_size == world
    finally:
        dist.destroy_process_group()


def save_with_rank_options(
    rank: int, world: int, init_file: str, url: str, options: list[dict[str, Any]]
) -> None:
    """A sync save where each rank has credentials of its own; rank 1's cannot write.
    Every rank must see the save fail, naming the denied write."""
    from torch.distributed.checkpoint.api import CheckpointException

    mesh = init_ranks(rank, world, init_file)
    try:
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()}
        writer = objckpt.ObjectStoreWriter(url, storage_options=options[rank])
        try:
            dcp.save(state, storage_writer=writer)
        except CheckpointException as exc:
            assert "AccessDenied" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: the save succeeded with a rank that cannot write")
    finally:
        dist.destroy_process_group()


def load_sharded(
    rank: int,
    world: int,
    init_file: str,
    url: str,
    options: dict[str, Any],
    with_step: bool = True,
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        expected = full_state()
        state: dict[str, Any] = {
            "model": {
                k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                for k, v in expected.items()
            },
        }
        if with_step:
            state["step"] = 0
        dcp.load(state, storage_reader=objckpt.ObjectStoreReader(url, storage_options=options))
        for k, v in expected.items():
            got = state["model"][k].full_tensor()
            assert torch.equal(got, v), f"rank {rank}: {k} differs after load"
        if with_step:
            assert state["step"] == 7
    finally:
        dist.destroy_process_group()


def async_save_sharded(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 7,
        }
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            handle = ckpt.save(state, url)
            for v in state["model"].values():
                v.to_local().add_(1)  # the loop moves on; the checkpoint must not see this
            manifest = handle.result(timeout=120)
            if rank == 0:
                assert manifest is not None and manifest.world_size == world
            else:
                assert manifest is None
    finally:
        dist.destroy_process_group()


def async_save_with_silent_rank(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Rank 1 never reports its uploads (as if it hung): everyone gets a timeout naming it."""
    from objckpt.pipeline import finalize

    mesh = init_ranks(rank, world, init_file)
    try:
        if rank == 1:
            finalize.RankExchange.post = lambda self, ok, payload: None  # type: ignore[method-assign]
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()}
        }
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=3)
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            handle = ckpt.save(state, url)
            try:
                handle.result(timeout=60)
            except objckpt.errors.ObjckptError as exc:
                # rank 0 times out naming rank 1; rank 1 hears rank 0's verdict
                assert "rank1" in str(exc) and "rank0" not in str(exc), str(exc)
            else:
                raise AssertionError("a save with a silent rank must not commit")
    finally:
        dist.destroy_process_group()


def async_save_with_killed_coordinator(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Step 1 commits; during step 2 rank 0 is SIGKILLed after its uploads, right
    where it would gather the ranks' results and commit. The other ranks must get
    an error naming rank 0 (within the barrier timeout) and write it to
    ``<init_file>.rank<r>``; the file says "committed" if a save wrongly succeeded."""
    import signal

    from objckpt.format.steps import step_name
    from objckpt.pipeline import finalize

    mesh = init_ranks(rank, world, init_file)
    state = {
        "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
        "step": 7,
    }
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=2)
    with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
        ckpt.save(state, f"{url}/{step_name(1)}").result(timeout=120)
        if rank == 0:

            def die(self: Any) -> list[Any]:
                os.kill(os.getpid(), signal.SIGKILL)
                raise AssertionError("unreachable")

            finalize.RankExchange.gather = die  # type: ignore[method-assign]
        handle = ckpt.save(state, f"{url}/{step_name(2)}")
        try:
            handle.result(timeout=120)
            verdict = "committed"
        except objckpt.errors.ObjckptError as exc:
            verdict = f"{type(exc).__name__}: {exc}"
    with open(f"{init_file}.rank{rank}", "w") as f:
        f.write(verdict)
    # The process group has a dead member: leave without its teardown collective.
    os._exit(0)


def queue_across_ranks(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Finalize runs only once every rank's work is done."""
    from objckpt import AsyncCallsQueue, AsyncRequest
    from objckpt.pipeline.finalize import StoreBarrier

    init_ranks(rank, world, init_file)
    try:
        finalized: list[int] = []
        queue = AsyncCallsQueue(barrier=StoreBarrier(), finalize_timeout=60)
        store = dist.distributed_c10d._get_default_store()
        # Rank 1's work cannot end before rank 0 has looked: it waits for rank 0's key.
        work = (lambda: store.wait(["rank0-looked"])) if rank == 1 else (lambda: None)
        idx = queue.schedule_async_request(AsyncRequest(work, (), [lambda: finalized.append(rank)]))
        assert idx == 0
        if rank == 0:
            assert queue.maybe_finalize_async_calls(blocking=False) == []  # rank 1 still busy
            assert finalized == []
            store.set("rank0-looked", "1")
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert finalized == [rank] and queue.get_num_unfinalized_calls() == 0
        queue.close()
    finally:
        dist.destroy_process_group()


def async_plan_cache(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Saves 1-4: unchanged, unchanged, changed on rank 1 only, unchanged.

    Every rank must agree on hit or miss (a rank that replays while another plans
    would deadlock in DCP's collectives), and every save must hold its own values.
    """
    _plan_cache_saves(rank, world, init_file, url, options, background=False)


def async_plan_cache_background(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """The same saves with background staging: hits copy on the commit thread."""
    _plan_cache_saves(rank, world, init_file, url, options, background=True)


def _plan_cache_saves(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any], background: bool
) -> None:
    from objckpt.pipeline.plan_cache import PlanCacheStats

    mesh = init_ranks(rank, world, init_file)
    try:
        base = full_state()
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120, background_staging=background)
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            state: dict[str, Any] = {}
            for step in range(4):
                state = {
                    "model": {
                        k: distribute_tensor(v + step, mesh, [Shard(0)]) for k, v in base.items()
                    },
                    "step": step,
                }
                if step >= 2 and rank == 1:
                    state["rank1_only"] = torch.full((3,), float(step))
                ckpt.save(state, f"{url}/step-{step}").result(timeout=120)
            assert ckpt.plan_cache_stats == PlanCacheStats(hits=2, misses=2), ckpt.plan_cache_stats
            # A refusal on one rank fails the save on every rank, before any upload.
            # (Only rank 0 asks "already committed?"; any rank's target check may refuse.)
            if rank == 1:
                objckpt.ObjectStoreWriter._check_target = _refuse  # type: ignore[method-assign]
            try:
                ckpt.save(state, f"{url}/refused")
            except objckpt.errors.ObjckptError as exc:
                expected = "injected refusal" if rank == 1 else "refused on rank 1"
                assert expected in str(exc), str(exc)
            else:
                raise AssertionError("a save refused on rank 1 must fail on every rank")
            assert ckpt.plan_cache_stats.hits == 2  # the refusal counted as neither
    finally:
        dist.destroy_process_group()


def _refuse(self: Any, plan: Any) -> None:
    raise objckpt.errors.CheckpointExistsError(f"injected refusal for {self.location.url}")


def manager_across_ranks(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Every rank saves through its manager; rank 0 alone deletes; all see the same steps."""
    _managed(rank, world, init_file, url, options, None)


def manager_across_ranks_spread(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """The same with persistent prefixes: rank 0's helper builds each ``.metadata``."""
    upload = objckpt.UploadOptions(prefix_entropy=1, persistent_prefixes=True)
    _managed(rank, world, init_file, url, options, upload)


def _managed(
    rank: int,
    world: int,
    init_file: str,
    url: str,
    options: dict[str, Any],
    upload: objckpt.UploadOptions | None,
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        base = full_state()
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
        with objckpt.CheckpointManager(
            url,
            storage_options=options,
            retention=objckpt.RetentionPolicy(keep_last=2),
            async_options=opts,
            upload=upload,
        ) as mgr:
            for step in (1, 2, 3):
                state = {
                    "model": {
                        k: distribute_tensor(v + step, mesh, [Shard(0)]) for k, v in base.items()
                    }
                }
                mgr.save(step, state).result(timeout=120)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [2, 3], (rank, mgr.all_steps())
            if rank != 0:
                try:
                    mgr.gc()
                except objckpt.errors.ConfigurationError as exc:
                    assert "coordinator" in str(exc)
                else:
                    raise AssertionError("gc must refuse to run on a non-coordinator")
            dist.barrier()
            got = {
                "model": {
                    k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                    for k, v in base.items()
                }
            }
            assert mgr.load(got) == 3
            for k, v in base.items():
                assert torch.equal(got["model"][k].full_tensor(), v + 3), k
    finally:
        dist.destroy_process_group()


def load_model_sharded(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Load only ``model.*`` (e.g. from an imported safetensors checkpoint), sharded."""
    load_sharded(rank, world, init_file, url, options, with_step=False)


def _tiered(rank: int, url: str, options: dict[str, Any], **tier: Any) -> objckpt.CheckpointManager:
    """A manager whose local tier is this rank's own directory (as on its own node),
    reaching the store through this rank's own proxy (so requests count per rank)."""
    return objckpt.CheckpointManager(
        url,
        storage_options=options["per_rank"][rank],
        async_options=objckpt.AsyncOptions(workers=1, barrier_timeout=120),
        local=objckpt.LocalTier(f"{options['local']}/node{rank}", **tier),
    )


def tiered_state(mesh: Any, step: int) -> dict[str, Any]:
    """``full_state`` plus ``step``, sharded over the mesh: each step's values differ."""
    return {
        "model": {
            k: distribute_tensor(v + step, mesh, [Shard(0)]) for k, v in full_state().items()
        },
        "step": step,
    }


def blank_tiered_state(mesh: Any) -> dict[str, Any]:
    """``tiered_state``'s shape with every value zero and ``step`` -1: what a load fills."""
    got = tiered_state(mesh, 0)
    for v in got["model"].values():
        v.to_local().zero_()
    got["step"] = -1
    return got


def tiered_save(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    """Steps 1 and 2 to the local tier, both promoted to the store."""
    mesh = init_ranks(rank, world, init_file)
    try:
        with _tiered(rank, url, options) as mgr:
            for step in (1, 2):
                handle = mgr.save(step, tiered_state(mesh, step))
                assert handle.tier == "local" and handle.wait_durable(120), rank
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2] and mgr.local_steps() == [1, 2], rank
            status = mgr.tier_status()
            assert (status.local_latest, status.durable_latest, status.steps_behind) == (2, 2, 0)
    finally:
        dist.destroy_process_group()


def tiered_load(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    """Restart: the latest step loads bit-exact from whatever mix of tiers holds it."""
    mesh = init_ranks(rank, world, init_file)
    try:
        with _tiered(rank, url, options) as mgr:
            got = {
                "model": {
                    k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                    for k, v in full_state().items()
                },
                "step": 0,
            }
            assert mgr.load(got) == 2
            for k, v in full_state().items():
                assert torch.equal(got["model"][k].full_tensor(), v + 2), (rank, k)
            assert got["step"] == 2
    finally:
        dist.destroy_process_group()


def tiered_one_rank_full(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Rank 1's local disk has no room (min_free_bytes beyond any disk): every rank
    saves that step to the store directly, and the step is durable."""
    mesh = init_ranks(rank, world, init_file)
    try:
        tier = {"min_free_bytes": 1 << 62} if rank == 1 else {}
        with _tiered(rank, url, options, **tier) as mgr:
            handle = mgr.save(1, tiered_state(mesh, 1))
            assert handle.tier == "primary", (rank, handle.tier)
            assert handle.wait_durable(120)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1] and mgr.local_steps() == [], rank
            why = mgr.tier_status().degraded or ""
            assert ("min_free_bytes" if rank == 1 else "another rank") in why, (rank, why)
    finally:
        dist.destroy_process_group()


def _sharded_tensor(rank: int, full: torch.Tensor, dim: int, placements: list[str]) -> Any:
    """``full`` as a ShardedTensor chunked along ``dim`` over ``placements`` (a rank
    named twice holds two local shards), each local shard holding its slice of ``full``."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=placements)
    st = sharded_tensor.zeros(spec, *full.shape)
    for shard in st.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        part = full
        for d, (start, length) in enumerate(zip(offsets, sizes, strict=True)):
            part = part.narrow(d, start, length)
        shard.tensor.copy_(part)
    return st


def _assert_holds(rank: int, st: Any, full: torch.Tensor, what: str) -> None:
    expected = _sharded_tensor(rank, full, st.sharding_spec().dim, st.sharding_spec().placements)
    assert len(st.local_shards()) == len(expected.local_shards()), (rank, what)
    for got, want in zip(st.local_shards(), expected.local_shards(), strict=True):
        assert got.metadata.shard_offsets == want.metadata.shard_offsets, (rank, what)
        assert torch.equal(got.tensor, want.tensor), f"rank {rank}: {what} differs after load"


#: Four chunks over two ranks: each rank holds two local shards (torch's own
#: test_file_system_checkpoint_cpu.py reshard layout).
TWO_SHARDS_EACH = ["rank:0/cpu", "rank:1/cpu", "rank:0/cpu", "rank:1/cpu"]


def save_sharded_tensor(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """A synchronous save of ShardedTensors with two local shards on every rank."""
    init_ranks(rank, world, init_file)
    try:
        full = full_state()
        state = {
            "model": {k: _sharded_tensor(rank, v, 0, TWO_SHARDS_EACH) for k, v in full.items()},
            "step": 7,
        }
        assert all(len(st.local_shards()) == 2 for st in state["model"].values())
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))
        # The async path does not stage ShardedTensors: refused naming the entry,
        # not torch's NotImplementedError from inside staging.
        try:
            objckpt.async_save(state, f"{url}-async", storage_options=options).result(60)
        except objckpt.errors.StateDictError as exc:
            assert "'model.w' is a ShardedTensor" in str(exc), str(exc)
        else:
            raise AssertionError("an async save of a ShardedTensor must be refused")
    finally:
        dist.destroy_process_group()


def load_sharded_tensor(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Load into the saved layout (two local shards each) and into another one (one
    rank holding two column chunks, the other one), values compared shard by shard."""
    init_ranks(rank, world, init_file)
    try:
        full = full_state()
        layouts = {  # resharded: three chunks of the last dimension
            "same": (lambda v: 0, TWO_SHARDS_EACH),
            "resharded": (lambda v: v.dim() - 1, ["rank:1/cpu", "rank:0/cpu", "rank:1/cpu"]),
        }
        for what, (dim, placements) in layouts.items():
            state: dict[str, Any] = {
                "model": {
                    k: _sharded_tensor(rank, torch.zeros_like(v), dim(v), placements)
                    for k, v in full.items()
                },
                "step": 0,
            }
            reader = objckpt.ObjectStoreReader(url, storage_options=options)
            dcp.load(state, storage_reader=reader)
            for k, v in full.items():
                _assert_holds(rank, state["model"][k], v, f"{what} {k}")
            assert state["step"] == 7
    finally:
        dist.destroy_process_group()
