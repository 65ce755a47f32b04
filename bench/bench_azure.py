"""Azure benchmark: objckpt's save and load against adlfs's plain put and cat of the
same bytes, on Azurite.

Measured in one run against one Azurite process (Node, plain HTTP, on the same
cores as the client), on ``--tensors`` fp32 tensors of equal size (#47's shape: the
per-byte cost with little per-tensor work):

* ``objckpt_save`` / ``objckpt_load``: ``dcp.save`` / ``dcp.load`` with
  ``ObjectStoreWriter`` / ``ObjectStoreReader`` (manifest, CRC32C, staged blocks for
  objects above two parts). The load goes into tensors allocated and written once,
  as a job restoring into its model's parameters does, so it pays no first touch.
* ``adlfs_put`` / ``adlfs_cat``: adlfs's ``pipe`` / ``cat`` of objects of the same
  sizes as the checkpoint's payload objects (all at once, adlfs's own batching): the
  floor for moving those bytes with adlfs, with nothing checked.

Every figure is the median of ``--repeats`` runs after one warm-up; CPU is this
process's user+system seconds (Azurite runs in its own process), per GiB moved.

Usage: ``python bench/bench_azure.py [--size-mib 256] [--tensors 16] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import smoke
import torch
import torch.distributed.checkpoint as dcp
from bench_sync import MiB, nbytes
from record import write_record

import objckpt
from objckpt import Location
from objckpt.testing.azurite import start_azurite

log = logging.getLogger("bench")
GiB = 1 << 30


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(fn: Callable[[], Any], moved: int, repeats: int) -> dict[str, Any]:
    """Median wall seconds and CPU seconds per GiB of ``repeats`` runs after a warm-up
    (each run's figures kept too)."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = _cpu(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append((_cpu() - c0) / (moved / GiB))
    return {
        "wall_s": round(statistics.median(walls), 3),
        "cpu_s_per_gib": round(statistics.median(cpus), 2),
        "runs_wall_s": [round(w, 3) for w in walls],
        "runs_cpu_s_per_gib": [round(c, 2) for c in cpus],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, tensors=4, repeats=1)
    warnings.filterwarnings("ignore")
    logging.getLogger("objckpt").setLevel(logging.ERROR)
    numel = args.size_mib * MiB // 4 // args.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    size = nbytes(state)
    server = start_azurite()
    results: dict[str, Any] = {}
    try:
        server.create_container("bench")
        options = server.storage_options()
        fs = Location.parse("az://bench/x", options).open_fs(fresh=True)

        def save() -> str:
            url = f"az://bench/ckpt-{uuid.uuid4().hex[:8]}"
            dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))
            return url

        results["objckpt_save"] = measure(save, size, args.repeats)
        url = save()
        reader = objckpt.ObjectStoreReader(url, storage_options=options)
        assert reader.manifest is not None
        payload = [o for o in reader.manifest.objects if o.key.endswith(".distcp")]
        target = {k: torch.ones_like(v) for k, v in state.items()}
        results["objckpt_load"] = measure(
            lambda: dcp.load(target, storage_reader=reader, checkpoint_id=url),
            size,
            args.repeats,
        )
        if not all(torch.equal(target[k], state[k]) for k in state):
            raise AssertionError("the load does not match the saved state")
        blobs = {o.key: os.urandom(o.size) for o in payload}
        moved = sum(len(b) for b in blobs.values())

        def put() -> str:
            prefix = f"bench/plain-{uuid.uuid4().hex[:8]}"
            fs.pipe({f"{prefix}/{k}": b for k, b in blobs.items()})
            return prefix

        results["adlfs_put"] = measure(put, moved, args.repeats)
        prefix = put()
        paths = [f"{prefix}/{k}" for k in blobs]
        results["adlfs_cat"] = measure(lambda: fs.cat(paths), moved, args.repeats)
    finally:
        server.stop()
    fields = {"size_bytes": size, "tensors": args.tensors, "results": results}
    path = write_record(args.out, "azure", args.size_mib, fields)
    brief = {k: {m: v[m] for m in ("wall_s", "cpu_s_per_gib")} for k, v in results.items()}
    print(json.dumps(brief))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
