"""Two-tier benchmark: local commit vs durable, and restart from local vs from S3.

Measured in one run, against one moto S3 server process, on the state dict of
``bench_sync.py`` (half in 6 large tensors, half in 1,000 small ones):

* ``s3_only``: ``CheckpointManager(root)``: the stall (until ``save`` returns)
  and the time until the step is committed on S3 (durable).
* ``tiered``: ``CheckpointManager(root, local=LocalTier(dir, promote_every=1))``:
  the stall, the time until the step is committed on the local disk, and the
  time until it is durable on S3 (the promotion included).
* ``restart_local`` / ``restart_s3``: a fresh manager's ``load()`` of the newest
  step, with the local tier (everything on this node's disk) and without it
  (everything from S3): the whole restart (building the manager, which lists
  the root and starts its upload workers, then ``load``) and ``load`` alone.

* ``node_loss`` (``--node-loss``): a job of 4 gloo ranks as 2 nodes of 2
  (torchrun's environment per rank, each node's tier in its own directory), at
  each ``--node-loss-mib`` total: with ``LocalTier(replicas=2)`` the time to
  replicated beside the local commit (and durable for the promoted step 1); then
  node 1's directory is deleted and the job restarts on a replacement: the newest
  step, local only, loads from the surviving node and its replicas (``peers``).
  The same job with ``replicas=1`` and every step promoted restarts after the same
  loss reading node 1's part from S3 (``store``): like with like, the same step,
  the same ranks. Restart and load seconds are rank 0's (every rank ends the load
  together), and so are the load's client CPU seconds, per GiB of rank 0's share.

Every save figure is the median of saves 2..N (warm against warm: the first
save pays for worker start and the plan); every restart the median of 3. The
local directory is on this machine's disk (``--local-dir``; node-local NVMe in
production), so its page cache is warm for ``restart_local``, as on a node
that restarts its job without a reboot.

Usage: ``python bench/bench_tiers.py [--size-mib 256] [--saves 4] [--node-loss
[--node-loss-mib 256 1024]]``; the node-loss job alone: ``--node-loss-only
--node-loss-mib 256 1024 --saves 3``; a smoke run with tiny sizes: ``--node-loss-only
--node-loss-mib 8 --saves 2 --out /tmp/bench-smoke``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import smoke
import torch
from bench_sync import MiB, nbytes, transformer_state
from record import write_record

import objckpt
from objckpt.testing.servers import offline_env, start_moto_server

log = logging.getLogger("bench")


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def _saves(mgr: objckpt.CheckpointManager, state: dict[str, torch.Tensor], n: int) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        for t in state.values():  # the training step: new values each save
            t.add_(1.0)
        started = time.perf_counter()
        handle = mgr.save(step, state)
        stall = time.perf_counter() - started
        handle.result()
        committed = time.perf_counter() - started
        handle.wait_durable()
        durable = time.perf_counter() - started
        out.append({"stall_s": stall, "commit_s": committed, "durable_s": durable})
        log.info("%s step %d: %s", handle.tier, step, out[-1])
    return out


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows[1:] or rows), 3)


def _restarts(
    make: Any, like: dict[str, torch.Tensor], step: int, n: int = 3
) -> list[tuple[float, float]]:
    """(whole restart: build the manager and load; the load alone), n times (once in a
    smoke run)."""
    out = []
    for _ in range(smoke.count(n, 1)):
        target = _empty_like(like)
        started = time.perf_counter()
        with make() as mgr:
            loading = time.perf_counter()
            assert mgr.load(target) == step
            done = time.perf_counter()
        out.append((done - started, done - loading))
    return out


# -- a lost node: 4 ranks as 2 nodes ------------------------------------------------------
NODE_WORLD = 4
PER_NODE = 2


def _node_rank(
    rank: int, world: int, init_file: str, root: str, o: dict[str, Any], phase: str
) -> None:
    """One rank of the node-loss job: ``phase`` "save" (steps 1..N) or "restore"."""
    import torch.distributed as dist

    os.environ.update(offline_env())
    os.environ.update(
        GROUP_RANK=str(rank // PER_NODE),
        LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
    )
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state = {f"r{rank}.{k}": v for k, v in transformer_state(max(1, o["mib"] // world)).items()}
    tier = objckpt.LocalTier(
        os.path.join(o["local"], f"node{rank // PER_NODE}"),
        retention=objckpt.RetentionPolicy(keep_last=2),
        promote_every=1 if o["replicas"] == 1 else 10**6,
        replicas=o["replicas"],
    )
    kw: dict[str, Any] = {"storage_options": o["storage"], "local": tier}
    rows = []
    try:
        if phase == "save":
            with objckpt.CheckpointManager(root, **kw) as mgr:
                for step in range(1, o["saves"] + 1):
                    for t in state.values():
                        t.add_(1.0)
                    started = time.perf_counter()
                    handle = mgr.save(step, state, promote=True if step == 1 else None)
                    stall = time.perf_counter() - started
                    handle.result()
                    row = {"stall_s": stall, "commit_s": time.perf_counter() - started}
                    if handle.wait_replicated():
                        row["replicated_s"] = time.perf_counter() - started
                    if handle.will_be_durable:
                        handle.wait_durable()
                        row["durable_s"] = time.perf_counter() - started
                    rows.append(row)
                mgr.wait_until_finished()
        else:
            for _ in range(3):
                target = _empty_like(state)
                started = time.perf_counter()
                cpu = time.process_time()
                with objckpt.CheckpointManager(root, **kw) as mgr:
                    loading = time.perf_counter()
                    cpu_loading = time.process_time()
                    assert mgr.load(target) == o["saves"]
                    rows.append(
                        {
                            "restart_s": time.perf_counter() - started,
                            "load_s": time.perf_counter() - loading,
                            "load_cpu_s": time.process_time() - cpu_loading,
                            "restart_cpu_s": time.process_time() - cpu,
                        }
                    )
                    mgr.wait_until_finished()  # the replacement's replicas, sent again
                dist.barrier()
                if rank == 0:  # the next restart loses node 1 again
                    shutil.rmtree(os.path.join(o["local"], "node1"), ignore_errors=True)
                dist.barrier()
        if rank == 0:
            with open(os.path.join(o["local"], f"{phase}.json"), "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _node_loss(size_mib: int, saves: int, storage: dict[str, Any], local_dir: str | None) -> dict:
    """The node-loss job at ``size_mib`` in total, with replicas (peers) and without
    (store); rank 0's figures."""
    import torch.multiprocessing as mp

    out: dict[str, Any] = {"size_mib": size_mib}
    for name, replicas in (("peers", 2), ("store", 1)):
        local = tempfile.mkdtemp(prefix="objckpt-nodes-", dir=local_dir)
        root = f"s3://bench/nodes-{name}-{size_mib}-{time.time_ns()}"
        o = {"mib": size_mib, "saves": saves, "storage": storage, "local": local}
        o["replicas"] = replicas
        try:
            for phase in ("save", "restore"):
                if phase == "restore":
                    shutil.rmtree(os.path.join(local, "node1"))
                init = os.path.join(local, f"init-{phase}")
                mp.spawn(_node_rank, args=(NODE_WORLD, init, root, o, phase), nprocs=NODE_WORLD)
            with open(os.path.join(local, "save.json")) as f:
                saved = json.load(f)
            with open(os.path.join(local, "restore.json")) as f:
                restored = json.load(f)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        gib = size_mib / 1024
        later = saved[1:] or saved
        row = {
            "stall_s": _median(saved, "stall_s"),
            "local_commit_s": _median(saved, "commit_s"),
            "durable_s_step1": round(saved[0]["durable_s"], 3),
            "restart_s": round(statistics.median(r["restart_s"] for r in restored), 3),
            "load_s": round(statistics.median(r["load_s"] for r in restored), 3),
            # rank 0's CPU seconds per GiB it loaded (its share of the state)
            "load_cpu_s_per_gib": round(
                statistics.median(r["load_cpu_s"] for r in restored) / (gib / NODE_WORLD), 3
            ),
            "raw": {"save": saved, "restore": restored},
        }
        if all("replicated_s" in r for r in later):
            row["replicated_s"] = _median(saved, "replicated_s")
        out[name] = row
        log.info(
            "node loss %d MiB, %s: %s", size_mib, name, {k: v for k, v in row.items() if k != "raw"}
        )
    return out


def _brief(value: Any) -> Any:
    return {k: v for k, v in value.items() if k != "raw"} if isinstance(value, dict) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--local-dir", default=None, help="the local tier's disk (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--node-loss", action="store_true", help="also the 4-rank node-loss job (peers vs store)"
    )
    ap.add_argument("--node-loss-mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--node-loss-only", action="store_true", help="only the node-loss job")
    smoke.add_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, saves=2)
    warnings.filterwarnings("ignore")
    os.environ.update(offline_env())
    server = start_moto_server()
    server.boto3_client().create_bucket(Bucket="bench")
    options = server.storage_options()
    if args.node_loss or args.node_loss_only:
        try:
            nodes = {
                "saves": args.saves,
                "runs": [
                    _node_loss(mib, args.saves, options, args.local_dir)
                    for mib in args.node_loss_mib
                ],
            }
        finally:
            if args.node_loss_only:
                server.stop()
        path = write_record(args.out, "tiers-nodes", max(args.node_loss_mib), nodes)
        for run in nodes["runs"]:
            print(json.dumps({k: _brief(v) for k, v in run.items()}, indent=2))
        print(f"wrote {path}")
        if args.node_loss_only:
            return
    state = transformer_state(args.size_mib)
    size = nbytes(state)
    local = tempfile.mkdtemp(prefix="objckpt-tier-", dir=args.local_dir)
    opts = objckpt.AsyncOptions()
    try:
        with objckpt.CheckpointManager(
            "s3://bench/s3only", storage_options=options, async_options=opts
        ) as mgr:
            s3_only = _saves(mgr, state, args.saves)
        tier = objckpt.LocalTier(
            local, retention=objckpt.RetentionPolicy(keep_last=2), promote_every=1
        )
        with objckpt.CheckpointManager(
            "s3://bench/tiered", storage_options=options, async_options=opts, local=tier
        ) as mgr:
            tiered = _saves(mgr, state, args.saves)
        restart_local = _restarts(
            lambda: objckpt.CheckpointManager(
                "s3://bench/tiered", storage_options=options, async_options=opts, local=tier
            ),
            state,
            args.saves,
        )
        restart_s3 = _restarts(
            lambda: objckpt.CheckpointManager(
                "s3://bench/tiered", storage_options=options, async_options=opts
            ),
            state,
            args.saves,
        )
    finally:
        server.stop()
        shutil.rmtree(local, ignore_errors=True)
    fields = {
        "size_bytes": size,
        "saves": args.saves,
        "s3_only": {
            "stall_s": _median(s3_only, "stall_s"),
            "durable_s": _median(s3_only, "durable_s"),
        },
        "tiered": {
            "stall_s": _median(tiered, "stall_s"),
            "local_commit_s": _median(tiered, "commit_s"),
            "durable_s": _median(tiered, "durable_s"),
        },
        "restart_local_s": round(statistics.median(r[0] for r in restart_local), 3),
        "restart_s3_s": round(statistics.median(r[0] for r in restart_s3), 3),
        "load_local_s": round(statistics.median(r[1] for r in restart_local), 3),
        "load_s3_s": round(statistics.median(r[1] for r in restart_s3), 3),
        "raw": {
            "s3_only": s3_only,
            "tiered": tiered,
            "restart_local": restart_local,
            "restart_s3": restart_s3,
        },
    }
    path = write_record(args.out, "tiers", args.size_mib, fields)
    print(json.dumps({k: v for k, v in fields.items() if k != "raw"}, indent=2))
    print(f"wrote {path} ({size / MiB:.0f} MiB state)")


if __name__ == "__main__":
    main()
