"""Azure benchmark: objckpt's save and load against adlfs's plain put and cat of the
same bytes, on Azurite.

Measured in one run against one Azurite process (Node, plain HTTP, on the same
cores as the client), on ``--tensors`` fp32 tensors of equal size (#47's shape: the
per-byte cost with little per-tensor work):

* ``objckpt_save`` / ``objckpt_load``: ``dcp.save`` / ``dcp.load`` with
  ``ObjectStoreWriter`` / ``ObjectStoreReader`` (manifest, CRC32C, staged blocks for
  objects above two parts). The load goes into tensors allocated and written once,
  as a job restoring into its model's parameters does, so it pays no first touch.
* ``adlfs_put`` / ``adlfs_cat``: adlfs's ``pipe`` / ``cat`` (through objckpt's
  subclass, with its retries, and without the checksum it sends with each body) of
  objects of the same sizes as the checkpoint's payload objects (all at once, adlfs's
  own batching): the floor for moving those bytes with adlfs, with nothing checked.

The rows are built as ``bench_gcs.py`` builds GCS's (:func:`bench_gcs.against_plain`).

``azurite_put_block_*``: Azurite's own CPU (from ``/proc``) per GiB staged, for Put
Blocks of ``--block-mib`` sent with a Content-MD5, with a CRC64 (as objckpt sends
them) and with neither (:func:`server_cost`): Azurite checks an MD5 natively but
computes a CRC64 in JavaScript, whenever one is sent or no MD5 is, and on a shared
machine its time is the save's wall time.

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
import warnings
from typing import Any

import smoke
import torch
from bench_gcs import against_plain
from bench_sync import MiB, nbytes
from record import write_record

from objckpt.testing.azurite import AzuriteUnavailable, start_azurite
from objckpt.writers.azureclient import RetryingAzureBlobFileSystem


def server_cost(server: Any, block_mib: int, blocks: int) -> dict[str, dict[str, float]]:
    """Azurite's CPU seconds per GiB and the wall seconds of ``blocks`` Put Blocks of
    ``block_mib`` MiB, for each check a block can carry, as objckpt's filesystem sends
    it (median of three rounds)."""
    fs = RetryingAzureBlobFileSystem(**server.storage_options(), skip_instance_cache=True)
    data = os.urandom(block_mib * MiB)
    checks: dict[str, dict[str, Any]] = {
        "md5": fs.transit_check(data, whole=False),
        "crc64": fs.transit_check(data),
        "none": {},
    }
    tick = os.sysconf("SC_CLK_TCK")

    def server_cpu() -> float:
        with open(f"/proc/{server.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in checks}
    server.create_container("probe")
    with server.blob_service_client() as client:
        blob = client.get_blob_client("probe", "blocks")
        for _ in range(3):
            for name, check in checks.items():
                cpu, started = server_cpu(), time.perf_counter()
                for n in range(blocks):
                    blob.stage_block(f"{n:06d}", data, length=len(data), **check)
                wall = time.perf_counter() - started
                rounds[name].append((wall, (server_cpu() - cpu) / (blocks * block_mib / 1024)))
    return {
        f"azurite_put_block_{name}": {
            "wall_s": round(statistics.median(w for w, _ in runs), 3),
            "server_cpu_s_per_gib": round(statistics.median(c for _, c in runs), 2),
        }
        for name, runs in rounds.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-mib", type=int, default=16, help="Put Blocks of server_cost")
    ap.add_argument("--blocks", type=int, default=8, help="Put Blocks per round of server_cost")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, tensors=4, repeats=1, block_mib=1, blocks=2)
    warnings.filterwarnings("ignore")
    logging.getLogger("objckpt").setLevel(logging.ERROR)
    numel = args.size_mib * MiB // 4 // args.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    size = nbytes(state)
    try:
        server = start_azurite()
    except AzuriteUnavailable as exc:
        # As a missing peer is: a logged line, unless this run must have Azurite
        # (CI, `make test`), as the Azure store tests must.
        required = (os.environ.get("CI", ""), os.environ.get("OBJCKPT_REQUIRE_AZURITE", ""))
        if any(flag.strip().lower() not in ("", "0", "false", "no") for flag in required):
            raise
        logging.getLogger("bench").warning("skipping: %s (`make azurite` installs it)", exc)
        return
    results: dict[str, Any] = {}
    try:
        server.create_container("bench")
        options = server.storage_options()
        results.update(
            against_plain(
                "az://bench",
                options,
                state,
                args.repeats,
                plain="adlfs",
                reuse_reader=True,
                # adlfs's own Put Blob: objckpt's filesystem sends each body's checksum.
                put_options={"validate_content": False},
            )
        )
        results.update(server_cost(server, args.block_mib, args.blocks))
    finally:
        server.stop()
    fields = {"size_bytes": size, "tensors": args.tensors, "results": results}
    path = write_record(args.out, "azure", args.size_mib, fields)
    brief = {k: {m: v[m] for m in v if not m.startswith("runs_")} for k, v in results.items()}
    print(json.dumps(brief))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
