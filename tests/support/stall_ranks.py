"""Rank bodies for test_stall_network.py (module-level, so spawn can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks

import objckpt


def refused_in_the_background(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """A bare save to a committed ``url`` on every rank, after a first save to the
    same bucket (its preflight is behind us). Each rank writes its handle's outcome
    to ``<init_file>.rank<r>``: the error's class and message, or "committed"."""
    init_ranks(rank, world, init_file)
    state = {"w": torch.full((4096,), float(rank)), "step": 3}
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=60)
    try:
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            ckpt.save(state, f"{url}-warm").result(timeout=120)
            handle = ckpt.save(state, url)  # returns: nobody waits for "committed?" here
            try:
                handle.result(timeout=120)
                verdict = "committed"
            except objckpt.errors.ObjckptError as exc:
                verdict = f"{type(exc).__name__}: {exc}"
        with open(f"{init_file}.rank{rank}", "w") as f:
            f.write(verdict)
    finally:
        dist.destroy_process_group()
