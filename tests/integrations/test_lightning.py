"""The Lightning CheckpointIO, driven by a real ``Trainer.fit`` on a tiny model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import no_dist_ranks
import pytest
import torch
from ranks import run_ranks

pl = pytest.importorskip("pytorch_lightning", reason="the lightning extra is not installed")

from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402

from objckpt import Location  # noqa: E402
from objckpt.format.layout import MANIFEST_KEY  # noqa: E402
from objckpt.lightning import ObjckptCheckpointIO  # noqa: E402
from objckpt.testing.plugin import StoreTarget  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, self.hparams.width, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(
    io: ObjckptCheckpointIO,
    dirpath: str,
    tmp_path,  # type: ignore[no-untyped-def]
    epochs: int,
    checkpoint: ModelCheckpoint | None = None,
    extra: tuple[pl.Callback, ...] = (),
) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        plugins=[io],
        callbacks=[
            checkpoint or ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1),
            *extra,
        ],
    )


@pytest.fixture
def lightning_env(s3_bucket: StoreTarget, monkeypatch):  # type: ignore[no-untyped-def]
    """ModelCheckpoint probes its dirpath with fsspec's defaults: point them at moto."""
    opts = s3_bucket.storage_options
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_bucket


# Lightning's own note when a resumed run writes into the directory it resumes from.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_trainer_fit_saves_committed_checkpoints_and_resumes(
    lightning_env: StoreTarget, tmp_path, async_save: bool
) -> None:
    target = lightning_env
    dirpath = target.url(f"lightning-{async_save}")
    io = ObjckptCheckpointIO(storage_options=target.storage_options, async_save=async_save)
    model = Tiny()
    _trainer(io, dirpath, tmp_path, epochs=2).fit(model)

    fs = Location.parse(dirpath, target.storage_options).open_fs(fresh=True)
    base = Location.parse(dirpath).path
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names
    for name in names:  # every checkpoint is an objckpt checkpoint, committed
        assert fs.exists(f"{base}/{name}/{MANIFEST_KEY}"), name

    # Resume from last.ckpt in a new Trainer: weights, optimizer and loop state come back.
    state = io.load_checkpoint(f"{dirpath}/last.ckpt")
    assert state["global_step"] == 8 and state["epoch"] == 1
    assert torch.equal(state["state_dict"]["net.weight"], model.net.weight.detach())
    adam = state["optimizer_states"][0]["state"]
    assert set(adam) == {0, 1} and float(adam[0]["step"]) == 8.0  # keyed by param index
    resumed = Tiny()
    io2 = ObjckptCheckpointIO(storage_options=target.storage_options, async_save=async_save)
    trainer = _trainer(io2, dirpath, tmp_path, epochs=3)
    trainer.fit(resumed, ckpt_path=f"{dirpath}/last.ckpt")
    assert trainer.global_step == 12  # continued from step 8, one more epoch of 4 steps
    assert fs.exists(f"{base}/epoch=2-step=12.ckpt/{MANIFEST_KEY}")


def test_remove_checkpoint_deletes_the_committed_checkpoint(
    lightning_env: StoreTarget, tmp_path
) -> None:
    target = lightning_env
    dirpath = target.url("lightning-top1")
    io = ObjckptCheckpointIO(storage_options=target.storage_options)
    top1 = ModelCheckpoint(dirpath=dirpath, save_top_k=1, monitor="step", mode="max")
    trainer = _trainer(io, dirpath, tmp_path, epochs=3, checkpoint=top1)
    trainer.fit(Tiny())
    fs = Location.parse(dirpath, target.storage_options).open_fs(fresh=True)
    base = Location.parse(dirpath).path
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base))
    assert names == ["epoch=2-step=12.ckpt"], names  # the older two were removed whole


def test_background_staging_waits_for_each_copy_before_the_optimizer_step(
    lightning_env: StoreTarget, tmp_path, monkeypatch
) -> None:
    """Every background copy is held until the callback waits for it, so an optimizer
    step that ran before that wait would see a copy still running."""
    import threading

    from objckpt import AsyncOptions
    from objckpt.pipeline.host_copy import HostCopier

    target = lightning_env
    dirpath = target.url("lightning-bg")
    io = ObjckptCheckpointIO(
        storage_options=target.storage_options,
        async_save=True,
        async_options=AsyncOptions(background_staging=True),
    )
    waited = threading.Event()
    real_wait, real_copy = ObjckptCheckpointIO.wait_staged, HostCopier.copy
    real_teardown = ObjckptCheckpointIO.teardown

    def wait_staged(self: ObjckptCheckpointIO) -> None:
        waited.set()
        real_wait(self)

    def teardown(self: ObjckptCheckpointIO) -> None:  # the last save has no step after it
        waited.set()
        real_teardown(self)

    def copy(self: HostCopier, *args) -> None:  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            assert waited.wait(60), "nobody waited for the background copy"
        real_copy(self, *args)

    monkeypatch.setattr(ObjckptCheckpointIO, "wait_staged", wait_staged)
    monkeypatch.setattr(ObjckptCheckpointIO, "teardown", teardown)
    monkeypatch.setattr(HostCopier, "copy", copy)
    steps: list[bool] = []

    class StepCheck(pl.Callback):
        """Runs after the staging callback, just before the optimizer changes the weights
        (Lightning calls callbacks in order, after the closure's forward and backward)."""

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            steps.append(all(h.wait_staged(timeout=0) for h in io._pending.values()))
            waited.clear()  # the next background copy waits for the next wait

    model = Tiny()
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=2)
    trainer = _trainer(
        io, dirpath, tmp_path, 2, checkpoint, extra=(io.staging_callback(), StepCheck())
    )
    trainer.fit(model)
    assert len(steps) == 8 and all(steps)
    fs = Location.parse(dirpath, target.storage_options).open_fs(fresh=True)
    base = Location.parse(dirpath).path
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base))
    assert names == [f"epoch={s // 5}-step={s}.ckpt" for s in (2, 4, 6, 8)], names
    # The last checkpoint holds the weights of the end of training.
    state = io.load_checkpoint(f"{dirpath}/epoch=1-step=8.ckpt")
    assert torch.equal(state["state_dict"]["net.weight"], model.net.weight.detach())


def test_background_staging_without_the_callback_is_refused(
    lightning_env: StoreTarget, tmp_path
) -> None:
    from objckpt import AsyncOptions
    from objckpt.errors import ConfigurationError

    io = ObjckptCheckpointIO(
        storage_options=lightning_env.storage_options,
        async_save=True,
        async_options=AsyncOptions(background_staging=True),
    )
    with pytest.raises(ConfigurationError, match="staging_callback"):
        _trainer(io, lightning_env.url("lightning-nocb"), tmp_path, epochs=1).fit(Tiny())
    with pytest.raises(ConfigurationError, match="wait_at='soon'"):
        io.staging_callback("soon")  # type: ignore[arg-type]


DDP_JOB = Path(__file__).parents[1] / "support" / "lightning_ddp_job.py"
#: Each job (two ranks starting, 3 or 2 steps) took 30-50 s here; one still running at this hangs.
DDP_TIMEOUT = 240.0


def _run_ddp_job(phase: str, dirpath: str, target: StoreTarget, out: Path) -> dict[int, dict]:
    """Run ``lightning_ddp_job.py`` (rank 0, which starts rank 1) and return each rank's
    record; a job still running after ``DDP_TIMEOUT`` fails the test as a hang."""
    command = [sys.executable, str(DDP_JOB), phase, dirpath]
    command += [json.dumps(target.storage_options), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A session of its own: rank 1 (rank 0's child) is killed with it on a hang.
    job = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = job.communicate(timeout=DDP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(
            f"the DDP job's {phase} did not end within {DDP_TIMEOUT:g} s "
            f"(a rank waits for the other in a collective):\n{output[-6000:]}"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # whatever of the job is left
    assert job.returncode == 0, f"the DDP job's {phase} exited {job.returncode}:\n{output[-6000:]}"
    return {r: json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_async_saves_under_ddp_commit_and_resume_on_every_rank(
    lightning_env: StoreTarget, tmp_path: Path
) -> None:
    """Lightning saves (and removes) on rank 0 only while rank 1 trains on: an async
    save that made a collective would wait for rank 1 forever (or pair with its
    gradient all-reduce). Every step is checkpointed, then a second job resumes."""
    target = lightning_env
    dirpath = target.url("lightning-ddp")
    fit = _run_ddp_job("fit", dirpath, target, tmp_path)
    assert [fit[r]["world_size"] for r in (0, 1)] == [2, 2]
    assert [fit[r]["end_step"] for r in (0, 1)] == [3, 3]

    fs = Location.parse(dirpath, target.storage_options).open_fs(fresh=True)
    base = Location.parse(dirpath).path
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base))
    # save_top_k=2: rank 0 removed step 1's checkpoint whole.
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"], names
    for name in names:
        assert fs.exists(f"{base}/{name}/{MANIFEST_KEY}"), name
    io = ObjckptCheckpointIO(storage_options=target.storage_options)
    last = io.load_checkpoint(f"{dirpath}/last.ckpt")
    assert last["global_step"] == 3
    saved = last["state_dict"]["net.weight"].flatten()
    assert torch.equal(saved, torch.tensor(fit[0]["end_weights"]))

    resume = _run_ddp_job("resume", dirpath, target, tmp_path)
    for r in (0, 1):  # every rank loaded last.ckpt: step and weights where fit ended
        assert resume[r]["start_step"] == 3, (r, resume[r])
        assert torch.equal(torch.tensor(resume[r]["start_weights"]), saved), r
        assert resume[r]["end_step"] == 5, (r, resume[r])
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=5.ckpt", "last.ckpt"], names
    assert io.load_checkpoint(f"{dirpath}/last.ckpt")["global_step"] == 5


@pytest.mark.timeout(300)
def test_calls_on_one_rank_of_a_process_group_make_no_collective(
    s3_bucket: StoreTarget, tmp_path: Path
) -> None:
    """Real gloo ranks: rank 0 saves (async), loads and removes while rank 1 waits on the
    c10d store (a collective would never be joined: the group's timeout fails it);
    then rank 1 loads a path holding nothing and gets CheckpointNotFoundError."""
    root = s3_bucket.url("one-rank")
    args = ("lightning_load_alone", 2, str(tmp_path / "init"), root, s3_bucket.storage_options)
    run_ranks(no_dist_ranks, *args)
    fs = Location.parse(root, s3_bucket.storage_options).open_fs(fresh=True)
    assert not fs.exists(Location.parse(f"{root}/step-1.ckpt").path)  # removed whole
