"""Compression ratio and client CPU per GiB of objckpt's opt-in codec, per dtype.

For each kind of state (#28 item 4):

* ``bf16_weights``: bfloat16 weights as a trained model starts them (normal, std 0.02);
* ``fp32_exp_avg``: fp32 Adam first moments (gradient EMAs, normal around 0, ~1e-3);
* ``fp32_exp_avg_sq``: fp32 Adam second moments (EMAs of squared gradients, ~1e-6,
  positive);

it compresses the item exactly as a save stores it (the ``torch.save`` frame head,
the tensor's bytes, the frame tail: :meth:`objckpt.format.compress.Codec.apply`),
with and without byte grouping, at zstd levels 1 and 3, and decodes it back as a
load does (:func:`~objckpt.format.compress.undo_transforms`, bounded), checking the
bytes come back equal. Reported per row: ratio (raw / stored), compress and
decompress CPU seconds per GiB of raw bytes (this process's user+sys: the codec is
single-threaded, as it runs in an upload worker), medians of ``--repeats`` runs.

A reference measured in the same run: CRC32C of the same bytes (what every save
already pays per byte), so the codec's cost reads as a multiple of it.

Usage: ``python bench/bench_compress.py [--size-mib 128] [--repeats 3]``
Results go to ``bench/results/compress-<date>-<size>mib.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import smoke
import torch
from record import write_record

from objckpt._torch import tensor_frame
from objckpt.format.compress import Codec, undo_transforms
from objckpt.writers.checksum import Crc32c

log = logging.getLogger("bench")
MiB = 1024 * 1024
GiB = 1024 * MiB


def states(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor of ``size_mib`` MiB per kind."""
    g = torch.Generator().manual_seed(seed)
    n16, n32 = size_mib * MiB // 2, size_mib * MiB // 4
    grad = torch.randn(n32, generator=g) * 1e-3
    return {
        "bf16_weights": (torch.randn(n16, generator=g) * 0.02).to(torch.bfloat16),
        "fp32_exp_avg": grad,
        "fp32_exp_avg_sq": (torch.randn(n32, generator=g) * 1e-3).square(),
    }


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def measure(tensor: torch.Tensor, codec: Codec, repeats: int) -> dict[str, Any]:
    """Ratio and CPU s/GiB to compress and to decompress ``tensor`` as a save stores it."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    frame = tensor_frame(tensor.dtype, tuple(tensor.shape))
    assert frame is not None
    raw_bytes = tensor.view(torch.uint8).numpy().data
    chunks = (frame[0], raw_bytes, frame[1])
    raw = len(frame[0]) + raw_bytes.nbytes + len(frame[1])
    comp, decomp = [], []
    stored = b""
    descriptors: tuple[str, ...] = ()
    for _ in range(repeats):
        seconds, (stored, descriptors, _) = _cpu(lambda: codec.apply(chunks, dtype))
        comp.append(seconds)
        seconds, back = _cpu(
            lambda s=stored, d=descriptors: undo_transforms(s, d, raw, what="bench")
        )
        decomp.append(seconds)
        if bytes(back[len(frame[0]) : len(frame[0]) + raw_bytes.nbytes]) != bytes(raw_bytes):
            raise RuntimeError("round trip changed the bytes")
    return {
        "descriptors": list(descriptors),
        "raw_bytes": raw,
        "stored_bytes": len(stored),
        "ratio": raw / len(stored),
        "compress_cpu_s_per_gib": statistics.median(comp) * GiB / raw,
        "decompress_cpu_s_per_gib": statistics.median(decomp) * GiB / raw,
    }


def crc_reference(tensor: torch.Tensor, repeats: int) -> float:
    """CRC32C CPU s/GiB of the same bytes (every save pays it)."""
    data = tensor.view(torch.uint8).numpy().data
    runs = []
    for _ in range(repeats):
        crc = Crc32c()
        seconds, _ = _cpu(lambda c=crc: c.update(data))
        runs.append(seconds)
    return statistics.median(runs) * GiB / data.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=128, help="MiB per tensor kind")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(args, size_mib=1, repeats=1)
    torch.set_num_threads(1)
    rows = []
    for kind, tensor in states(args.size_mib).items():
        crc = crc_reference(tensor, args.repeats)
        for grouping in (False, True):
            for level in (1, 3):
                row = {
                    "kind": kind,
                    "byte_grouping": grouping,
                    "level": level,
                    "crc32c_cpu_s_per_gib": crc,
                    **measure(tensor, Codec(level=level, byte_grouping=grouping), args.repeats),
                }
                rows.append(row)
                log.info(
                    "%-16s %-10s zstd:%d  ratio %.3f  compress %.2f CPU-s/GiB  "
                    "decompress %.2f CPU-s/GiB  (CRC32C %.3f)",
                    kind,
                    "bytegroup" if grouping else "plain",
                    level,
                    row["ratio"],
                    row["compress_cpu_s_per_gib"],
                    row["decompress_cpu_s_per_gib"],
                    crc,
                )
    path = write_record(
        args.out, "compress", args.size_mib, {"repeats": args.repeats, "rows": rows}
    )
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
