"""The demo behind ``objckpt demo``: train, checkpoint, restart, verify.

It trains a small MLP on CPU, checkpoints every few steps to an S3 bucket (an
embedded moto server it starts itself, or ``--url``), then builds a fresh model,
restores the newest committed checkpoint and checks that every weight matches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from objckpt.errors import CheckpointNotFoundError
from objckpt.location import Location
from objckpt.storage_reader import ObjectStoreReader
from objckpt.storage_writer import ObjectStoreWriter

__all__ = ["DemoResult", "SaveRecord", "run_demo"]

logger = logging.getLogger(__name__)
_STEP = re.compile(r"step-(\d{10})$")


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    step: int
    bytes: int
    save_seconds: float


@dataclasses.dataclass(frozen=True)
class DemoResult:
    saves: tuple[SaveRecord, ...]
    restored_step: int
    load_seconds: float
    weights_match: bool
    url: str


def _model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@contextlib.contextmanager
def _embedded_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    from objckpt.testing.servers import offline_env, start_moto_server

    for key, value in offline_env().items():
        os.environ.setdefault(key, value)
    server = start_moto_server()
    try:
        server.boto3_client().create_bucket(Bucket="objckpt-demo")
        yield "s3://objckpt-demo/run", server.storage_options()
    finally:
        server.stop()


def _latest_step(root: Location) -> int:
    fs = root.open_fs(fresh=True)
    steps = []
    for name in fs.ls(root.path, detail=False):
        m = _STEP.search(str(name).rstrip("/"))
        if m and fs.exists(f"{root.path}/{m.group(0)}/manifest.json"):
            steps.append(int(m.group(1)))
    if not steps:
        raise CheckpointNotFoundError(f"no committed step under {root.url}")
    return max(steps)


def run_demo(
    *,
    steps: int = 300,
    every: int = 50,
    width: int = 256,
    url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> DemoResult:
    """Train, checkpoint every ``every`` steps, restore the latest, compare weights."""
    with contextlib.ExitStack() as stack:
        # Single-process DCP warns that no process group exists; that is the point here.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if url is None:
            url, storage_options = stack.enter_context(_embedded_s3())
        root = Location.parse(url, storage_options)
        torch.manual_seed(0)
        model = _model(width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(512, 32), torch.randn(512, 1)
        saves = []
        snapshot: dict[str, torch.Tensor] = {}
        for step in range(1, steps + 1):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if step % every == 0:
                ckpt = root.child(f"step-{step:010d}")
                writer = ObjectStoreWriter(
                    ckpt.url, storage_options=storage_options, overwrite=True
                )
                t0 = time.perf_counter()
                dcp.save(_state(model, opt, step), storage_writer=writer, no_dist=True)
                elapsed = time.perf_counter() - t0
                size = writer.last_manifest.total_bytes if writer.last_manifest else 0
                writer.close()
                saves.append(SaveRecord(step, size, elapsed))
                snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
                logger.info(
                    "step %d loss %.4f saved %d bytes in %.2f s", step, loss.item(), size, elapsed
                )

        # "Restart": a fresh model and optimizer, restored from the newest commit.
        latest = _latest_step(root)
        torch.manual_seed(1)
        restored = _model(width)
        restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-3)
        restored_opt.zero_grad()
        restored(x).sum().backward()
        restored_opt.step()  # materialise optimizer state so DCP can load into it
        state = _state(restored, restored_opt, 0)
        t0 = time.perf_counter()
        reader = ObjectStoreReader(
            root.child(f"step-{latest:010d}").url, storage_options=storage_options
        )
        dcp.load(state, storage_reader=reader, no_dist=True)
        load_seconds = time.perf_counter() - t0
        restored.load_state_dict(state["model"])
        match = state["step"] == latest and all(
            torch.equal(snapshot[k], v) for k, v in restored.state_dict().items()
        )
        return DemoResult(tuple(saves), latest, load_seconds, bool(match), root.url)
