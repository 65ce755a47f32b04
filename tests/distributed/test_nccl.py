"""End to end on NCCL: a job whose process group has no CPU backend saves and loads
CUDA state through the manager (async, shared replicated reads) and through plain
DCP. It needs CUDA and NCCL; without them (CI, this project's CPU machines) it is
skipped with the reason. ``tests/distributed/test_fault_matrix.py`` proves objckpt's
collectives on ``cuda:gloo``, which refuses CPU tensors as NCCL does, on CPU."""

from __future__ import annotations

from pathlib import Path

import nccl_ranks
import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from objckpt.testing.plugin import StoreTarget

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs CUDA and NCCL (run it where a GPU is lent)",
)


def test_save_and_load_on_an_nccl_only_group(s3_bucket: StoreTarget, tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())  # NCCL allows one rank per GPU
    args = (
        "save_and_load_on_nccl",
        world,
        str(tmp_path / "init"),
        s3_bucket.url("run"),
        s3_bucket.storage_options,
    )
    run_ranks(nccl_ranks, *args)
