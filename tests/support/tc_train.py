"""A training loop that checkpoints through torch_checkpointing on objckpt's Storage.

``tc_train.py ROOT OPTIONS_JSON --hang-at N``: train, saving asynchronously after every
step; step N's save stops in its writer subprocess once every file of it is uploaded,
after printing ``staged N`` (the test SIGKILLs the process group there). Prints
``committed N`` once step N's save has returned.

``tc_train.py ROOT OPTIONS_JSON --resume OUT``: load the newest committed step, train
to step 4 saving each step, and ``torch.save`` the state at resume and at the end to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

STEPS = 4


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def announce_and_maybe_hang(args: Any) -> None:
    """torch_checkpointing's pre-finalize callback (in its writer subprocess): every file
    of the save is uploaded, the commit (the rename) not yet made."""
    name = Path(args.path).name
    print(f"staged {name.removeprefix('tmp_step_')}", flush=True)
    if name == f"tmp_step_{os.environ.get('TC_HANG_AT', '')}":
        threading.Event().wait()  # until SIGKILLed


def manager(root: str, options: dict[str, Any]) -> Any:
    from torch_checkpointing import CheckpointManager

    from objckpt.torch_checkpointing import ObjckptStorageConfig

    config = CheckpointManager.Config(
        storage_config=ObjckptStorageConfig(root=root, storage_options=options),
        pre_finalize_callback=announce_and_maybe_hang,
    )
    return CheckpointManager(config)


def _payload(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("options")
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--resume")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    options = json.loads(ns.options)
    if ns.hang_at is not None:
        os.environ["TC_HANG_AT"] = str(ns.hang_at)
    model, opt = build()
    mgr = manager(ns.root, options)
    first, out = 1, {}
    if ns.resume:
        from objckpt.torch_checkpointing import ObjckptStorageConfig

        storage = ObjckptStorageConfig(root=ns.root, storage_options=options).create_storage()
        steps = [int(n[len("step_") :]) for n in storage.ls(Path("")) if n.startswith("step_")]
        latest = max(steps)
        train_step(model, opt, 0)  # creates the optimizer state the load fills in place
        loaded = mgr.load(f"step_{latest}", into=_payload(model, opt, 0))
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        print(f"resumed from step_{latest}", flush=True)
        out["at_resume"] = {k: v.clone() for k, v in model.state_dict().items()}
        first = latest + 1
    try:
        for step in range(first, STEPS + 1):
            with mgr.lock():
                train_step(model, opt, step)
            future = mgr.save(f"step_{step}", _payload(model, opt, step))
            print(f"saving {step}", flush=True)
            future.result(timeout=120)
            print(f"committed {step}", flush=True)
    finally:
        mgr.close()
    if ns.resume:
        out["final"] = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(out, ns.resume)


if __name__ == "__main__":
    main()
