"""Rank bodies of tests/test_rank_commit.py (module-level so spawn can import them)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch.distributed as dist
from dist_helpers import _init, full_state
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt


def rank_main(rank: int, body: str, *args: Any) -> None:
    """Run ``body`` of this module, then leave without interpreter teardown (see
    dist_helpers.rank_main: torch 2.13's gloo threads may abort at finalization)."""
    globals()[body](rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_twice(
    rank: int, world: int, init_file: str, urls: list[str], options: dict[str, Any], out: str
) -> None:
    """An async save to each of ``urls`` in turn; each rank records each outcome in
    ``<out>.rank<r>.json`` (``"committed"``, or the error's class and message)."""
    mesh = _init(rank, world, init_file)
    outcomes = []
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 3,
        }
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=60)
        upload = objckpt.UploadOptions(deadline=20.0)  # retries end by then
        with objckpt.AsyncCheckpointer(
            storage_options=options, upload=upload, async_options=opts
        ) as ckpt:
            for url in urls:
                try:
                    ckpt.save(state, url).result(timeout=120)
                    outcomes.append("committed")
                except objckpt.errors.ObjckptError as exc:
                    outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(outcomes, f)
        dist.destroy_process_group()
