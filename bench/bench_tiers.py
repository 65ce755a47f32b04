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

Every save figure is the median of saves 2..N (warm against warm: the first
save pays for worker start and the plan); every restart the median of 3. The
local directory is on this machine's disk (``--local-dir``; node-local NVMe in
production), so its page cache is warm for ``restart_local``, as on a node
that restarts its job without a reboot.

Usage: ``python bench/bench_tiers.py [--size-mib 256] [--saves 4]``.
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
    """(whole restart: build the manager and load; the load alone), n times."""
    out = []
    for _ in range(n):
        target = _empty_like(like)
        started = time.perf_counter()
        with make() as mgr:
            loading = time.perf_counter()
            assert mgr.load(target) == step
            done = time.perf_counter()
        out.append((done - started, done - loading))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--local-dir", default=None, help="the local tier's disk (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    warnings.filterwarnings("ignore")
    os.environ.update(offline_env())
    state = transformer_state(args.size_mib)
    size = nbytes(state)
    server = start_moto_server()
    server.boto3_client().create_bucket(Bucket="bench")
    options = server.storage_options()
    local = tempfile.mkdtemp(prefix="objckpt-tier-", dir=args.local_dir)
    opts = objckpt.AsyncOptions()
    try:
        with objckpt.CheckpointManager(
            "s3://bench/s3only", storage_options=options, async_options=opts
        ) as mgr:
            s3_only = _saves(mgr, state, args.saves)
        tier = objckpt.LocalTier(local, keep_last=2, promote_every=1)
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
