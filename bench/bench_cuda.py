"""The async stall for CUDA state, next to the device-to-host copy it cannot avoid.

Run where a GPU is lent (CI has none: without CUDA it says so and exits 0). One
process, one GPU, state in GPU memory (bf16 "weights" in a few large tensors and
many small ones, as ``bench_sync.transformer_state`` shapes them), saved to a local
``file://`` root so that the store is not what is measured:

* ``copy_pinned``: ``copy_(non_blocking=True)`` of every tensor into preallocated
  page-locked host buffers, then one ``torch.cuda.synchronize()``: the floor for a
  stall that must not see later writes to the GPU tensors;
* ``copy_pageable``: the same into ordinary (pageable) host memory;
* ``objckpt_async``: ``AsyncCheckpointer.save`` reused across saves (its default
  staging: pinned shared memory); stall = ``save()`` returning, commit = ``result()``;
* ``objckpt_async_bg``: with ``background_staging``; stall, and ``staged_s`` =
  ``wait_staged()`` returning;
* ``dcp_async``: ``dcp.async_save`` (thread executor, ``FsspecWriter``) with its
  default staging;
* ``dcp_async_bg``: ``dcp.async_save`` with torch's ``DefaultStager`` (pinned,
  non-blocking, async staging) and its ``FsspecWriter``; stall and staged as above.

Every figure is the median of the second and later of ``--saves`` saves (warm
against warm). Usage: ``python bench/bench_cuda.py [--size-mib 1024] [--saves 5]
[--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import smoke
import torch

log = logging.getLogger("bench")


def cuda_state(size_mib: int) -> dict[str, torch.Tensor]:
    """``size_mib`` MiB of bf16 on the GPU: 85% in 6 large tensors, the rest in 1,000."""
    big = size_mib * 1024 * 1024 * 85 // 100 // 6 // 2
    small = max(1, (size_mib * 1024 * 1024 - 6 * big * 2) // 1000 // 2)
    state = {f"big.{i}": torch.randn(big, dtype=torch.bfloat16, device="cuda") for i in range(6)}
    state.update(
        {f"small.{i}": torch.randn(small, dtype=torch.bfloat16, device="cuda") for i in range(1000)}
    )
    return state


def _median_tail(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def copy_floor(state: dict[str, torch.Tensor], saves: int, pinned: bool) -> float:
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    out = []
    for _ in range(saves):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v, non_blocking=pinned)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return _median_tail(out)


def _series(save: Callable[[int], dict[str, float]], saves: int) -> dict[str, float]:
    rows = [save(i) for i in range(saves)]
    return {k: _median_tail([r[k] for r in rows]) for k in rows[0]}


def objckpt_series(
    state: dict[str, torch.Tensor], root: str, saves: int, background: bool
) -> dict[str, float]:
    import objckpt

    options = objckpt.AsyncOptions(background_staging=background)
    with objckpt.AsyncCheckpointer(async_options=options) as ckpt:

        def one(i: int) -> dict[str, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = ckpt.save(state, f"{root}/objckpt-{int(background)}-{i}")
            stall = time.perf_counter() - t0
            row = {"stall_s": stall}
            if background:
                handle.wait_staged()
                row["staged_s"] = time.perf_counter() - t0
            handle.result(timeout=600)
            row["commit_s"] = time.perf_counter() - t0
            shutil.rmtree(f"{root}/objckpt-{int(background)}-{i}".removeprefix("file://"))
            return row

        return _series(one, saves)


def dcp_series(
    state: dict[str, torch.Tensor], root: str, saves: int, background: bool
) -> dict[str, float]:
    """``dcp.async_save`` with its thread executor and ``FsspecWriter``; with
    ``background``, torch's ``DefaultStager`` (pinned, non-blocking, async staging)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    stager = (
        DefaultStager(
            StagingOptions(
                use_pinned_memory=True, use_non_blocking_copy=True, use_async_staging=True
            )
        )
        if background
        else None
    )

    def one(i: int) -> dict[str, float]:
        path = f"{root}/dcp-{int(background)}-{i}".removeprefix("file://")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"async_stager": stager} if stager is not None else {}
        response = dcp.async_save(
            state,
            storage_writer=FsspecWriter(path, sync_files=False),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            no_dist=True,
            **kwargs,
        )
        row = {"stall_s": time.perf_counter() - t0}
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
            row["staged_s"] = time.perf_counter() - t0
            response.upload_completion.result()
        else:
            response.result()
        row["commit_s"] = time.perf_counter() - t0
        shutil.rmtree(path)
        return row

    try:
        return _series(one, saves)
    finally:
        if stager is not None:
            stager.close()


def run(size_mib: int, saves: int) -> dict[str, Any]:
    state = cuda_state(size_mib)
    gib = sum(v.numel() * v.element_size() for v in state.values()) / 2**30
    out: dict[str, Any] = {
        "gib": gib,
        "tensors": len(state),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_pinned_s": copy_floor(state, saves, pinned=True),
        "copy_pageable_s": copy_floor(state, saves, pinned=False),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = f"file://{tmp}"
        series: dict[str, Callable[[], dict[str, float]]] = {
            "objckpt_async": lambda: objckpt_series(state, root, saves, background=False),
            "objckpt_async_bg": lambda: objckpt_series(state, root, saves, background=True),
            "dcp_async": lambda: dcp_series(state, root, saves, background=False),
            "dcp_async_bg": lambda: dcp_series(state, root, saves, background=True),
        }
        for name, measure in series.items():
            try:  # one series failing (a torch without DefaultStager, say) loses only it
                out[name] = measure()
            except Exception as exc:
                log.exception("%s failed", name)
                out[name] = {"error": repr(exc)}
    return out


def table(res: dict[str, Any]) -> str:
    floor = res["copy_pinned_s"]
    lines = [
        f"{res['gib']:.2f} GiB of bf16 in {res['tensors']} tensors on {res['device']} "
        f"(torch {res['torch']}); medians of warm saves",
        "| what | stall s | x pinned copy | staged s | commit s |",
        "|---|---|---|---|---|",
        f"| D2H copy into preallocated pinned memory | {floor:.3f} | 1.00 | | |",
        f"| D2H copy into preallocated pageable memory | {res['copy_pageable_s']:.3f} "
        f"| {res['copy_pageable_s'] / floor:.2f} | | |",
    ]
    for name, key in [
        ("objckpt async (default)", "objckpt_async"),
        ("objckpt async, background staging", "objckpt_async_bg"),
        ("dcp.async_save (thread, its default staging)", "dcp_async"),
        ("dcp.async_save, DefaultStager pinned async", "dcp_async_bg"),
    ]:
        r = res[key]
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        staged = f"{r['staged_s']:.3f}" if "staged_s" in r else ""
        lines.append(
            f"| {name} | {r['stall_s']:.3f} | {r['stall_s'] / floor:.2f} | {staged} "
            f"| {r['commit_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, nargs="+", default=[1024])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here")
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if smoke.apply(args, size_mib=[4], saves=2):
        args.out = os.path.join(args.out, "cuda.json")
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        log.info("no CUDA device: nothing to measure (run it where a GPU is lent)")
        sys.exit(0)
    results = [run(size, args.saves) for size in args.size_mib]
    for res in results:
        log.info("%s\n", table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
