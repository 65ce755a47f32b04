"""Sync save/load benchmark: objckpt beside torch DCP's writers and the store's ceiling.

Every figure is a median of ``--repeats`` runs, and every ratio compares methods
measured in the same run on the same machine:

S3 (a moto server process on loopback):
  * ``boto3_upload``: boto3's managed multipart upload of the same bytes (the ceiling)
  * ``objckpt_save`` / ``objckpt_load``: dcp.save/load with ObjectStoreWriter/Reader
  * ``fsspec_save`` / ``fsspec_load``: dcp.save/load with torch's FsspecWriter/Reader
Local disk:
  * ``plain_write``: each tensor's raw bytes written to files of the same grouping, fsynced
  * ``objckpt_save``: ObjectStoreWriter to file://
  * ``dcp_fs_save``: torch's FileSystemWriter

Usage: ``python bench/bench_sync.py [--size-mib 1024] [--repeats 3] [--only s3|local]``
Results go to ``bench/results/sync-<date>.json`` and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import smoke
import torch
import torch.distributed.checkpoint as dcp
from record import write_record
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import objckpt
from objckpt.testing.servers import offline_env, start_moto_server

log = logging.getLogger("bench")
MiB = 1024 * 1024


def transformer_state(total_mib: int, tensors: int | None = None) -> dict[str, torch.Tensor]:
    """About ``total_mib`` of fp32: half in 6 large tensors, half in ~1,000 small ones
    (20 in a smoke run), or in ``tensors - 6`` small ones where ``tensors`` is given
    (a state of many small tensors: LoRA adapters, MoE optimizer states)."""
    g = torch.Generator().manual_seed(0)
    big_each = total_mib * MiB // 2 // 6 // 4
    small_count = smoke.count(1000 if tensors is None else max(1, tensors - 6), 20)
    small_each = total_mib * MiB // 2 // small_count // 4
    state: dict[str, torch.Tensor] = {}
    for i in range(6):
        state[f"big.{i}"] = torch.randn(big_each, generator=g)
    for i in range(small_count):
        state[f"layers.{i // 10}.p{i % 10}"] = torch.randn(small_each, generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(
    fn: Callable[[], Any], setup: Callable[[], Any] | None = None, repeats: int = 3
) -> list[float]:
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def bench_s3(state: dict[str, torch.Tensor], repeats: int) -> dict[str, list[float]]:
    os.environ.update(offline_env())
    server = start_moto_server()
    try:
        client = server.boto3_client()
        opts = server.storage_options()
        fsspec_kwargs = {
            "endpoint_url": opts["endpoint_url"],
            "key": opts["key"],
            "secret": opts["secret"],
        }

        def fresh_bucket() -> None:
            server.reset()
            client.create_bucket(Bucket="bench")

        from boto3.s3.transfer import TransferConfig

        # The same bytes as one blob: what a hand-written boto3 upload would send.
        blob = [b"".join(t.numpy().tobytes() for t in state.values())]

        def boto3_upload() -> None:
            client.upload_fileobj(io.BytesIO(blob[0]), "bench", "blob", Config=TransferConfig())

        results: dict[str, list[float]] = {}
        results["boto3_upload"] = timed(boto3_upload, fresh_bucket, repeats)
        blob.clear()

        def objckpt_save() -> None:
            dcp.save(
                state,
                storage_writer=objckpt.ObjectStoreWriter("s3://bench/ck", storage_options=opts),
            )

        def objckpt_load() -> None:
            target = zeros_like(state)
            dcp.load(
                target,
                storage_reader=objckpt.ObjectStoreReader("s3://bench/ck", storage_options=opts),
            )

        results["objckpt_save"] = timed(objckpt_save, fresh_bucket, repeats)
        results["objckpt_load"] = timed(objckpt_load, None, repeats)
        check = zeros_like(state)
        dcp.load(
            check, storage_reader=objckpt.ObjectStoreReader("s3://bench/ck", storage_options=opts)
        )
        assert all(torch.equal(check[k], state[k]) for k in state), (
            "objckpt load returned wrong data"
        )

        def fsspec_save() -> None:
            dcp.save(
                state,
                storage_writer=FsspecWriter("s3://bench/fs", sync_files=False, **fsspec_kwargs),
            )

        def fsspec_load() -> None:
            target = zeros_like(state)
            dcp.load(target, storage_reader=FsspecReader("s3://bench/fs", **fsspec_kwargs))

        results["fsspec_save"] = timed(fsspec_save, fresh_bucket, repeats)
        results["fsspec_load"] = timed(fsspec_load, None, repeats)
        return results
    finally:
        server.stop()


def bench_local(state: dict[str, torch.Tensor], repeats: int) -> dict[str, list[float]]:
    root = tempfile.mkdtemp(prefix="objckpt-bench-", dir=os.environ.get("BENCH_DIR"))
    target = os.path.join(root, "ck")

    def clean() -> None:
        shutil.rmtree(target, ignore_errors=True)
        os.sync()

    def plain_write() -> None:
        # Same grouping objckpt uses: each large tensor alone, small ones packed to 64 MiB.
        os.makedirs(target)
        n, size, f = 0, 0, None
        for t in state.values():
            data = memoryview(t.numpy()).cast("B")
            if f is None or size + len(data) > 64 * MiB:
                if f is not None:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
                f = open(os.path.join(target, f"f{n}"), "wb")  # noqa: SIM115
                n, size = n + 1, 0
            f.write(data)
            size += len(data)
        assert f is not None
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def objckpt_save() -> None:
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(f"file://{target}"))

    def dcp_fs_save() -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(target))

    try:
        return {
            "plain_write": timed(plain_write, clean, repeats),
            "objckpt_save": timed(objckpt_save, clean, repeats),
            "dcp_fs_save": timed(dcp_fs_save, clean, repeats),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["s3", "local"], default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, repeats=1)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # steady copy timings on a small, busy machine

    state = transformer_state(args.size_mib)
    size = nbytes(state)
    log.info("state dict: %d tensors, %.1f MiB", len(state), size / MiB)
    runs: dict[str, dict[str, list[float]]] = {}
    if args.only in (None, "s3"):
        runs["s3"] = bench_s3(state, args.repeats)
        log.info("s3: %s", runs["s3"])
    if args.only in (None, "local"):
        runs["local"] = bench_local(state, args.repeats)
        log.info("local: %s", runs["local"])

    med = {group: {k: statistics.median(v) for k, v in r.items()} for group, r in runs.items()}
    ratios: dict[str, float] = {}
    if "s3" in med:
        s3 = med["s3"]
        ratios["s3_save_throughput_vs_boto3"] = s3["boto3_upload"] / s3["objckpt_save"]
        ratios["s3_save_speedup_vs_fsspec"] = s3["fsspec_save"] / s3["objckpt_save"]
        ratios["s3_load_speedup_vs_fsspec"] = s3["fsspec_load"] / s3["objckpt_load"]
    if "local" in med:
        loc = med["local"]
        ratios["local_save_vs_plain_write"] = loc["objckpt_save"] / loc["plain_write"]
        ratios["dcp_fs_save_vs_plain_write"] = loc["dcp_fs_save"] / loc["plain_write"]
    fields = {
        "bytes": size,
        "tensors": len(state),
        "repeats": args.repeats,
        "runs_seconds": runs,
        "median_seconds": med,
        "ratios": ratios,
    }
    path = write_record(args.out, "sync", args.size_mib, fields)
    lines = ["| store | method | median s | MB/s |", "|---|---|---:|---:|"]
    for group, r in med.items():
        for k, v in r.items():
            lines.append(f"| {group} | {k} | {v:.2f} | {size / v / 1e6:.0f} |")
    lines.append("")
    lines += [f"- {k}: {v:.2f}x" for k, v in ratios.items()]
    print("\n".join(lines))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
