"""GCS benchmark: objckpt's save and load against gcsfs's plain put and cat of the
same bytes, and one large object as a parallel composite upload against one request.

Measured in one run against one fake-gcs-server process (Go, in memory, plain
HTTP; the Python gcp-storage-emulator is too slow to say anything about the
client), on the state dict of ``bench_sync.py``:

* ``objckpt_save`` / ``objckpt_load``: ``dcp.save`` / ``dcp.load`` with
  ``ObjectStoreWriter`` / ``ObjectStoreReader`` (manifest, CRC32C, composite
  uploads for objects above two parts).
* ``gcsfs_put`` / ``gcsfs_cat``: gcsfs's ``pipe`` / ``cat`` of objects of the same
  sizes as the checkpoint's payload objects (all at once, gcsfs's own batching):
  the floor for moving those bytes with gcsfs, with nothing checked.
* ``composite`` / ``single_request`` / ``media_request``: one object of
  ``--object-mib`` through :class:`~objckpt.writers.gcs_compose.CompositeUpload`
  (16 MiB pieces, 8 in flight), through gcsfs's ``pipe_file`` (one request, or
  resumable chunks of 50 MiB in turn above that), and through
  :class:`~objckpt.writers.gcs_compose.MediaUpload` (one streamed request: what
  objckpt sends for an object of up to two parts).

Every figure is the median of ``--repeats`` runs after one warm-up; CPU is this
process's user+system seconds (the server runs in its own process), per GiB moved.

Usage: ``python bench/bench_gcs.py [--size-mib 256] [--object-mib 256] [--repeats 3]``.
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

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import smoke
import torch
import torch.distributed.checkpoint as dcp
from bench_sync import MiB, nbytes, transformer_state
from record import write_record

import objckpt
from objckpt import Location, UploadOptions
from objckpt.testing.servers import offline_env, start_fake_gcs_server
from objckpt.writers import open_store
from objckpt.writers.base import BufferedUpload
from objckpt.writers.gcs_compose import CompositeUpload, MediaUpload

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


def against_plain(
    root: str,
    options: dict[str, Any],
    state: dict[str, torch.Tensor],
    repeats: int,
    *,
    plain: str,
    reuse_reader: bool,
    put_options: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """objckpt's save and load of ``state`` under ``root`` (``scheme://bucket``), and the
    client's own ``pipe`` and ``cat`` of objects of the checkpoint's payload sizes
    (rows ``<plain>_put``, ``<plain>_cat``): the floor for moving those bytes with that
    client, nothing checked. ``reuse_reader``: loads through one reader into tensors
    allocated and written once (a job restoring into its parameters), else through a
    new reader each into tensors allocated once (written by the warm-up load only).
    ``put_options``: keywords of the client's ``pipe`` that keep it checking nothing
    where objckpt's filesystem would add a check."""
    size = nbytes(state)
    fs = Location.parse(f"{root}/x", options).open_fs(fresh=True)

    def save() -> str:
        url = f"{root}/ckpt-{uuid.uuid4().hex[:8]}"
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))
        return url

    out = {"objckpt_save": measure(save, size, repeats)}
    url = save()
    reader = objckpt.ObjectStoreReader(url, storage_options=options)
    assert reader.manifest is not None
    payload = [o for o in reader.manifest.objects if o.key.endswith(".distcp")]
    if reuse_reader:
        target = {k: torch.ones_like(v) for k, v in state.items()}
        load = lambda: dcp.load(target, storage_reader=reader, checkpoint_id=url)  # noqa: E731
    else:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        load = lambda: dcp.load(  # noqa: E731
            target, storage_reader=objckpt.ObjectStoreReader(url, storage_options=options)
        )
    out["objckpt_load"] = measure(load, size, repeats)
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError("the load does not match the saved state")
    blobs = {o.key: os.urandom(o.size) for o in payload}
    moved = sum(len(b) for b in blobs.values())
    bucket = root.split("://", 1)[1]

    def put() -> str:
        prefix = f"{bucket}/plain-{uuid.uuid4().hex[:8]}"
        fs.pipe({f"{prefix}/{k}": b for k, b in blobs.items()}, **(put_options or {}))
        return prefix

    out[f"{plain}_put"] = measure(put, moved, repeats)
    prefix = put()
    paths = [f"{prefix}/{k}" for k in blobs]
    out[f"{plain}_cat"] = measure(lambda: fs.cat(paths), moved, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--object-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=16, help="composite piece size")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, object_mib=11, part_mib=5, repeats=1)
    warnings.filterwarnings("ignore")
    os.environ.update(offline_env())
    server = start_fake_gcs_server()
    server.create_bucket("bench")
    options = server.storage_options()
    state = transformer_state(args.size_mib)
    size = nbytes(state)
    results: dict[str, Any] = {}
    try:
        results.update(
            against_plain(
                "gs://bench", options, state, args.repeats, plain="gcsfs", reuse_reader=False
            )
        )

        data = os.urandom(args.object_mib * MiB)
        opts = UploadOptions(part_size=args.part_mib * MiB, max_parts_in_flight=8)

        def one_object(how: str) -> None:
            store = open_store(
                Location.parse(f"gs://bench/obj-{uuid.uuid4().hex[:8]}", options), opts
            )
            upload = store.begin("big.distcp", len(data))
            assert isinstance(upload, CompositeUpload)
            if how == "gcsfs":
                upload = BufferedUpload(store, "big.distcp", len(data))
            elif how == "media":
                upload = MediaUpload(store, "big.distcp", opts.part_size)
            for i in range(0, len(data), 8 * MiB):
                upload.write(data[i : i + 8 * MiB])
            upload.close().result()
            store.close()

        results["composite"] = measure(lambda: one_object("composite"), len(data), args.repeats)
        results["single_request"] = measure(lambda: one_object("gcsfs"), len(data), args.repeats)
        results["media_request"] = measure(lambda: one_object("media"), len(data), args.repeats)
    finally:
        server.stop()
    fields = {"size_bytes": size, "object_bytes": args.object_mib * MiB, "results": results}
    path = write_record(args.out, "gcs", args.size_mib, fields)
    print(json.dumps(fields, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
