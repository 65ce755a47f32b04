"""Async save benchmark: stall, time to commit and peak host memory.

Measured in one run, against one moto S3 server process, on the same state dict
as ``bench_sync.py`` (1 GiB fp32: 6 large tensors, 1,000 small ones):

* ``copy_limit``: copying the state dict into preallocated buffers (the floor for
  any stall that must not see later mutation)
* ``objckpt_async``: ``AsyncCheckpointer.save`` (reused across saves): the stall is
  the time until it returns, commit the time until ``result()`` returns
* ``dcp_async_thread`` / ``dcp_async_process``: ``torch.distributed.checkpoint.async_save``
  with torch's ``FsspecWriter`` and its thread / process executor, one ``DefaultStager``
  reused across saves (DCP's cached staging); every figure is the median of the
  second and later saves (warm against warm)
* ``objckpt_sync``: ``dcp.save`` with ``ObjectStoreWriter`` (the Core sync save)

Peak memory is the sum of PSS (proportional set size, so shared staging memory is
counted once) over this process and its children, sampled every 20 ms, minus the
PSS before the first save; it is compared to the state dict's size.

Usage: ``python bench/bench_async.py [--size-mib 1024] [--saves 5] [--world 1]``.
With ``--world N`` it also measures the stall at world size N (gloo on CPU, the
same total bytes sharded over the ranks).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import threading
import time
import warnings
from typing import Any

import smoke
import torch
import torch.distributed.checkpoint as dcp
from bench_sync import MiB, nbytes, transformer_state
from proc_stats import Collections
from record import write_record
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import objckpt
from objckpt.testing.servers import offline_env, start_moto_server

log = logging.getLogger("bench")


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                out.extend(_tree(int(child)))
    except OSError:
        pass
    return out


class PeakMemory:
    """Samples the summed PSS of this process tree (excluding given pids)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        return sum(_pss_kib(p) for p in _tree(os.getpid()) if p not in self.exclude) * 1024

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> PeakMemory:
        self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def copy_limit(state: dict[str, torch.Tensor], repeats: int) -> list[float]:
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        out.append(time.perf_counter() - t0)
    return out


class _CommitCpu:
    """The CPU each in-thread commit of this process spends (``time.thread_time`` of
    ``commit_checkpoint``, on the save's commit thread): what a one-rank job's commit
    costs beside training (#47), apart from the workers' uploads."""

    def __init__(self) -> None:
        from objckpt.pipeline import commit_phase

        self._module = commit_phase
        self._real = commit_phase.commit_checkpoint
        self.seconds: list[float] = []

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds.append(time.thread_time() - t0)

        commit_phase.commit_checkpoint = timed  # type: ignore[assignment]

    def close(self) -> None:
        self._module.commit_checkpoint = self._real  # type: ignore[assignment]


def _async_series(
    state: dict[str, torch.Tensor],
    storage_options: dict[str, Any],
    options: objckpt.AsyncOptions | None,
    name: str,
    saves: int,
    server_pid: int,
    baseline: int,
) -> dict[str, Any]:
    """``saves`` saves through one checkpointer: stall, commit and peak memory of each."""
    stalls, commits, peaks = [], [], []
    in_stall, per_save = [], []
    commit_cpu = _CommitCpu()
    try:
        with (
            Collections() as gcs,
            objckpt.AsyncCheckpointer(
                storage_options=storage_options, async_options=options
            ) as ckpt,
        ):
            for i in range(saves):
                with PeakMemory({server_pid}) as mem:
                    before = gcs.full
                    t0 = time.perf_counter()
                    handle = ckpt.save(state, f"s3://bench/{name}/step-{i}")
                    during = gcs.full
                    stalls.append(time.perf_counter() - t0)
                    in_stall.append(during - before)
                    handle.result()
                    commits.append(time.perf_counter() - t0)
                    per_save.append(gcs.full - before)
                peaks.append(mem.peak - baseline)
                log.info(
                    "%s save %d: stall %.3f s, commit %.2f s, peak +%.0f MiB",
                    name,
                    i,
                    stalls[-1],
                    commits[-1],
                    peaks[-1] / MiB,
                )
            cache = ckpt.plan_cache_stats
    finally:
        commit_cpu.close()
    return {
        "full_collections_in_stall": in_stall,
        "full_collections_per_save": per_save,
        "stall": stalls,
        "commit": commits,
        "commit_thread_cpu": commit_cpu.seconds,
        "peak_extra_bytes": peaks,
        "plan_cache": {"hits": cache.hits, "misses": cache.misses},
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(offline_env())
    state = transformer_state(args.size_mib, args.tensors)
    size = nbytes(state)
    server = start_moto_server()
    opts = server.storage_options()
    client = server.boto3_client()
    client.create_bucket(Bucket="bench")
    fsspec_kwargs = {
        "endpoint_url": opts["endpoint_url"],
        "key": opts["key"],
        "secret": opts["secret"],
    }
    res: dict[str, Any] = {"bytes": size}
    try:
        res["copy_limit"] = copy_limit(state, args.saves)
        log.info("copy limit %s", res["copy_limit"])

        # objckpt async: one checkpointer reused for every save, as in training.
        baseline = PeakMemory({server.process.pid}).sample()
        res["objckpt_async"] = _async_series(
            state, opts, None, "async", args.saves, server.process.pid, baseline
        )
        if args.budget_mib:
            # The same saves with staging bounded: waves trade stall for memory.
            series = _async_series(
                state,
                opts,
                objckpt.AsyncOptions(staging_budget=args.budget_mib * MiB),
                "budget",
                min(args.saves, 3),
                server.process.pid,
                baseline,
            )
            res["objckpt_async_budget"] = {"budget_bytes": args.budget_mib * MiB, **series}

        # torch's process executor needs a process group, even for one rank.
        import torch.distributed as dist

        init_dir = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{init_dir}/pg", rank=0, world_size=1)
        cuda = torch.cuda.is_available()
        for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
            d_stalls, d_done = [], []
            # Like for like: DCP at its best documented setup, one stager reused across
            # saves (it caches the staged copy, as objckpt's checkpointer does), the
            # CUDA-only options on only where there is CUDA; the same number of saves.
            stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=kind == AsyncCheckpointerType.PROCESS,
                    use_async_staging=cuda,
                    use_non_blocking_copy=cuda,
                )
            )
            for i in range(args.saves):
                writer = FsspecWriter(
                    f"s3://bench/dcp-{kind.value}/step-{i}", sync_files=False, **fsspec_kwargs
                )
                t0 = time.perf_counter()
                try:
                    out = dcp.async_save(
                        state,
                        storage_writer=writer,
                        async_checkpointer_type=kind,
                        async_stager=stager,
                    )
                    d_stalls.append(time.perf_counter() - t0)
                    fut = getattr(out, "upload_completion", out)
                    fut.result()
                    d_done.append(time.perf_counter() - t0)
                except Exception as exc:  # report, do not hide
                    log.warning("dcp.async_save (%s) failed: %r", kind.value, exc)
                    res[f"dcp_async_{kind.value}_error"] = repr(exc)
                    break
                log.info(
                    "dcp async (%s) %d: stall %.3f s, done %.2f s",
                    kind.value,
                    i,
                    d_stalls[-1],
                    d_done[-1],
                )
            res[f"dcp_async_{kind.value}"] = {"stall": d_stalls, "commit": d_done}
            stager.close()

        dist.destroy_process_group()
        syncs = []
        for i in range(0 if args.skip_sync else min(args.saves, 3)):
            t0 = time.perf_counter()
            dcp.save(
                state,
                storage_writer=objckpt.ObjectStoreWriter(
                    f"s3://bench/sync/step-{i}", storage_options=opts
                ),
            )
            syncs.append(time.perf_counter() - t0)
        res["objckpt_sync"] = syncs
        log.info("objckpt sync %s", syncs)
    finally:
        server.stop()
    return res


def _rank_main(
    rank: int,
    world: int,
    init: str,
    url: str,
    options: dict[str, Any],
    size_mib: int,
    saves: int,
    out_dir: str,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(offline_env())
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = transformer_state(size_mib)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    del full
    stalls = []
    with objckpt.AsyncCheckpointer(storage_options=options) as ckpt:
        for i in range(saves):
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(state, f"{url}/step-{i}")
            stalls.append(time.perf_counter() - t0)
            handle.result()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(stalls, f)
    dist.destroy_process_group()


def bench_world(world: int, size_mib: int, saves: int) -> list[list[float]]:
    import torch.multiprocessing as mp

    os.environ.update(offline_env())
    server = start_moto_server()
    server.boto3_client().create_bucket(Bucket="bench")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(
                _rank_main,
                args=(
                    world,
                    f"{tmp}/init",
                    f"s3://bench/ws{world}",
                    server.storage_options(),
                    size_mib,
                    saves,
                    tmp,
                ),
                nprocs=world,
                join=True,
            )
            return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--world", type=int, nargs="*", default=[])
    parser.add_argument(
        "--budget-mib", type=int, default=0, help="also measure saves with this staging budget"
    )
    parser.add_argument(
        "--tensors",
        type=int,
        default=None,
        help="tensors in the state dict: 6 large ones and the rest small (default 1,006); "
        "the stall's per-tensor work shows at thousands",
    )
    parser.add_argument(
        "--skip-sync",
        action="store_true",
        help="leave out the sync save (its figures are bench_sync's; the stall needs none)",
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, saves=2, world=[], budget_mib=0, tensors=None)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    res = bench(args)
    med = statistics.median
    later = slice(1, None)  # second and later saves (the first allocates staging)
    a = res["objckpt_async"]
    summary: dict[str, float] = {
        "copy_limit_s": med(res["copy_limit"]),
        "objckpt_stall_later_s": med(a["stall"][later]),
        "objckpt_stall_first_s": a["stall"][0],
        "objckpt_commit_s": med(a["commit"][later]),
        "objckpt_commit_thread_cpu_later_s": med(a["commit_thread_cpu"][later]),
        # inside save(): the total over the later saves (a median would hide one that
        # lands in the stall); per save: their mean
        "objckpt_full_collections_in_stall_later": sum(a["full_collections_in_stall"][later]),
        "objckpt_full_collections_per_save_later": sum(a["full_collections_per_save"][later])
        / max(1, len(a["full_collections_per_save"][later])),
        "objckpt_sync_s": med(res["objckpt_sync"]) if res["objckpt_sync"] else float("nan"),
        "peak_extra_over_state": max(a["peak_extra_bytes"]) / res["bytes"],
        "peak_growth_last_vs_second": a["peak_extra_bytes"][-1] / a["peak_extra_bytes"][1],
    }
    for kind in ("thread", "process"):
        d = res.get(f"dcp_async_{kind}", {})
        if d.get("stall"):
            # Warm against warm: the first save of every series (allocating staging,
            # starting processes) is left out of every median.
            summary[f"dcp_async_{kind}_stall_s"] = med(d["stall"][later] or d["stall"])
            if d["commit"]:  # none where its first save failed (the process executor
                # runs out of file descriptors at 10,000 tensors: torch passes one each)
                summary[f"dcp_async_{kind}_done_s"] = med(d["commit"][later] or d["commit"])
    ratios = {
        "stall_vs_copy_limit": summary["objckpt_stall_later_s"] / summary["copy_limit_s"],
        "commit_vs_sync_save": summary["objckpt_commit_s"] / summary["objckpt_sync_s"],
    }
    if "dcp_async_thread_stall_s" in summary:
        ratios["stall_vs_dcp_async_thread"] = (
            summary["objckpt_stall_later_s"] / summary["dcp_async_thread_stall_s"]
        )
    if "dcp_async_process_stall_s" in summary:
        ratios["stall_vs_dcp_async_process"] = (
            summary["objckpt_stall_later_s"] / summary["dcp_async_process_stall_s"]
        )
    if "objckpt_async_budget" in res:
        b = res["objckpt_async_budget"]
        summary["budget_stall_s"] = med(b["stall"])
        summary["budget_commit_s"] = med(b["commit"])
        summary["budget_peak_extra_over_state"] = max(b["peak_extra_bytes"]) / res["bytes"]
    worlds = {}
    for w in args.world:
        per_rank = bench_world(w, args.size_mib, max(3, min(args.saves, 4)))
        worlds[str(w)] = {
            "stall_per_rank": per_rank,
            "median_later_stall_s": med([s for r in per_rank for s in r[1:]]),
        }
        log.info("world %d: %s", w, worlds[str(w)])
    fields = {
        "bytes": res["bytes"],
        "raw": res,
        "summary": summary,
        "ratios": ratios,
        "world": worlds,
    }
    if args.tensors is not None:
        fields["tensors"] = args.tensors
    path = write_record(args.out, "async", args.size_mib, fields)
    for k, v in {**summary, **ratios}.items():
        print(f"{k}: {v:.3f}")
    for w, d in worlds.items():
        print(f"world {w} median stall (later saves): {d['median_later_stall_s']:.3f} s")
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
