"""Rank bodies of the bounded-wait tests (module-level so spawn can import them).

Each rank writes what each save did to it (outcome, error type and text) to
``<out>/<what>.rank<r>.json``; the parent test reads the files, and a rank that hung
leaves none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks

import objckpt
from objckpt.pipeline.commit_phase import WEDGED_AFTER

DEADLINE = 3.0
#: Longer than the deadline plus WEDGED_AFTER: rank 0 hears rank 1's own failure.
BARRIER = 60.0
#: How long a save may take to fail with a wedged worker: deadline, grace, and slack
#: for a loaded machine (before the fix the save never ended).
BOUND = DEADLINE + WEDGED_AFTER + 30.0


def _record(out: str, what: str, rank: int, fn: Callable[[], Any]) -> None:
    try:
        fn()
        report = {"outcome": "ok", "type": "", "error": ""}
    except BaseException as exc:
        report = {"outcome": "error", "type": type(exc).__name__, "error": str(exc)}
    with open(os.path.join(out, f"{what}.rank{rank}.json"), "w") as f:
        json.dump(report, f)


def stop_workers(ckpt: objckpt.AsyncCheckpointer) -> list[subprocess.Popen[bytes]]:
    """Stop (SIGSTOP) every upload worker of ``ckpt``: a worker that never answers."""
    gen = ckpt._pool._gen
    procs = [] if gen is None else [p for p in gen.procs if p.poll() is None]
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    return procs


def end(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill what :func:`stop_workers` stopped, if the checkpointer did not (Popen
    never signals a pid it has reaped, so a reused pid is safe)."""
    for proc in procs:
        proc.kill()


def wedged_worker_on_rank_1(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    """Rank 1's only upload worker is stopped (SIGSTOP) before a save: it never
    answers. Every rank must fail that save by its deadline, then save again."""
    init_ranks(rank, world, init_file)
    state = {f"r{rank}.w": torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))}
    upload = objckpt.UploadOptions(deadline=DEADLINE)
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=BARRIER)
    try:
        with objckpt.AsyncCheckpointer(upload=upload, async_options=opts) as ckpt:
            ckpt.save(state, f"{root}/warm").result(timeout=120)  # the worker is up
            stopped = stop_workers(ckpt) if rank == 1 else []
            try:
                _record(
                    out,
                    "wedged",
                    rank,
                    lambda: ckpt.save(state, f"{root}/wedged").result(timeout=BOUND),
                )
            finally:
                end(stopped)  # before the fix nothing else ends them
            _record(
                out, "after", rank, lambda: ckpt.save(state, f"{root}/after").result(timeout=120)
            )
    finally:
        dist.destroy_process_group()
