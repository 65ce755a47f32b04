"""Child job for the Lightning DDP test: a real ``Trainer(strategy="ddp", devices=2)``.

Lightning's ``ddp`` strategy starts its other ranks by running this script again
(``LOCAL_RANK=1 python lightning_ddp_job.py ...``), which a pytest process cannot
be, so the test runs it as a program of its own and bounds it with a timeout: a
rank waiting in a collective the others never make is a hang, not an error.

Usage::

    python tests/support/lightning_ddp_job.py fit|resume DIRPATH OPTIONS_JSON OUT_DIR

``fit`` trains 3 steps from scratch with a checkpoint after every step (the two
newest kept, plus ``last.ckpt``); ``resume`` continues from ``DIRPATH/last.ckpt``
to step 5. Each rank writes ``OUT_DIR/<phase>-rank<r>.json``: the global step and
the weights when training started and when it ended.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from objckpt.lightning import ObjckptCheckpointIO
from objckpt.options import AsyncOptions


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=8)  # 4 steps per rank and epoch


class Record(pl.Callback):
    """What each rank saw: the step and weights it started from, and where it ended."""

    def __init__(self, out: str, phase: str) -> None:
        self.out, self.phase = out, phase
        self.seen: dict[str, Any] = {}

    def _weights(self, pl_module: pl.LightningModule) -> list[float]:
        return pl_module.state_dict()["net.weight"].flatten().tolist()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["start_step"] = trainer.global_step
        self.seen["start_weights"] = self._weights(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["end_step"] = trainer.global_step
        self.seen["end_weights"] = self._weights(pl_module)
        self.seen["world_size"] = trainer.world_size
        path = os.path.join(self.out, f"{self.phase}-rank{trainer.global_rank}.json")
        with open(path, "w") as f:
            json.dump(self.seen, f)


def main() -> None:
    phase, dirpath, options, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    io = ObjckptCheckpointIO(
        storage_options=options, async_save=True, async_options=AsyncOptions(workers=1)
    )
    # save_top_k=2 makes rank 0 remove older checkpoints while the other rank trains.
    checkpoint = ModelCheckpoint(
        dirpath=dirpath,
        every_n_train_steps=1,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=3 if phase == "fit" else 5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(out, "root"),
        plugins=[io],
        callbacks=[checkpoint, Record(out, phase)],
    )
    ckpt_path = None if phase == "fit" else f"{dirpath}/last.ckpt"
    trainer.fit(Tiny(), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
