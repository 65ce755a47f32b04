"""The demo behind ``objckpt demo``: train, checkpoint, restart, verify.

It trains a small MLP on CPU and checkpoints every few steps with a
:class:`~objckpt.CheckpointManager` (async saves, keep the last 3) to an S3
bucket: an embedded moto server it starts itself, or ``--url``. Then it builds a
fresh manager and model as a restarted job would, restores the newest committed
step and checks that every weight matches the values at the moment of the save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from objckpt.errors import ConfigurationError
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.run.manager import CheckpointManager
from objckpt.writers.location import Location

__all__ = ["DemoResult", "SaveRecord", "run_demo"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    step: int
    bytes: int
    save_seconds: float  # how long training waited (the async save's stall)


@dataclasses.dataclass(frozen=True)
class DemoResult:
    saves: tuple[SaveRecord, ...]
    restored_step: int
    load_seconds: float
    weights_match: bool
    url: str
    kept_steps: tuple[int, ...] = ()


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


def run_demo(
    *,
    steps: int = 300,
    every: int = 50,
    width: int = 256,
    url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    keep_last: int = 3,
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
        mgr = stack.enter_context(
            CheckpointManager(
                root.url,
                storage_options=storage_options,
                retention=RetentionPolicy(keep_last=keep_last),
            )
        )
        if mgr.all_steps():
            raise ConfigurationError(
                f"the demo needs an empty root; {root.url} already holds steps {mgr.all_steps()}"
            )
        pending: list[tuple[int, float, Any]] = []
        for step in range(1, steps + 1):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if step % every == 0:
                t0 = time.perf_counter()
                handle = mgr.save(step, _state(model, opt, step))
                stall = time.perf_counter() - t0
                # The checkpoint holds the values at the call: training goes on at once.
                snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
                pending.append((step, stall, handle))
                logger.info("step %d loss %.4f: save returned in %.3f s", step, loss.item(), stall)
                if handle.waited_for_earlier > 0.05:
                    logger.info(
                        "  of which %.3f s waiting for the previous save's uploads to finish "
                        "(AsyncOptions.max_saves_in_flight=1: one save uploading at a time)",
                        handle.waited_for_earlier,
                    )
        mgr.wait_until_finished()
        for step, stall, handle in pending:
            manifest = handle.result()
            saves.append(SaveRecord(step, manifest.total_bytes if manifest else 0, stall))

        # "Restart": a fresh manager, model and optimizer, restored from the newest commit.
        resumed = stack.enter_context(CheckpointManager(root.url, storage_options=storage_options))
        torch.manual_seed(1)
        restored = _model(width)
        restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-3)
        restored_opt.zero_grad()
        restored(x).sum().backward()
        restored_opt.step()  # materialise optimizer state so DCP can load into it
        state = _state(restored, restored_opt, 0)
        t0 = time.perf_counter()
        latest = resumed.load(state)
        load_seconds = time.perf_counter() - t0
        restored.load_state_dict(state["model"])
        match = state["step"] == latest and all(
            torch.equal(snapshot[k], v) for k, v in restored.state_dict().items()
        )
        kept = tuple(resumed.all_steps())
        return DemoResult(tuple(saves), latest, load_seconds, bool(match), root.url, kept)
