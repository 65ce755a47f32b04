"""torchtitan 0.3.0's own trainer and CheckpointManager, saving to objckpt on s3:// (moto).

torchtitan is not in objckpt's test environment; these run in a venv that has it
(docs/guides/torchtitan.md says how to make one) and skip elsewhere. The end-to-end
test runs ``bench/titan_run.py``: the llama3 debug model, 2 ranks, gloo on CPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (see guides/torchtitan.md)")
if not hasattr(torch.distributed, "set_timeout"):
    pytest.skip(
        f"torchtitan 0.3.0 calls torch.distributed.set_timeout, which torch {torch.__version__} "
        "lacks (torch 2.15.0 has it)",
        allow_module_level=True,
    )

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import torch.distributed.checkpoint as dcp  # noqa: E402
from titan_objckpt import ObjckptCheckpointManager  # noqa: E402

import objckpt  # noqa: E402
from objckpt.testing.plugin import StoreTarget  # noqa: E402


def test_find_load_step_takes_committed_steps_only(s3_bucket: StoreTarget) -> None:
    """A step whose manifest is missing (still uploading, or failed) is not resumed from,
    though it has DCP's ``.metadata``, which is what torchtitan's own test looks for."""
    folder = s3_bucket.url("checkpoint")
    for step in (1, 10):
        dcp.save(
            {"w": torch.full((4,), float(step))},
            storage_writer=objckpt.ObjectStoreWriter(
                f"{folder}/step-{step}", storage_options=s3_bucket.storage_options
            ),
        )
    fs, root = fsspec.core.url_to_fs(folder, **s3_bucket.storage_options)
    fs.rm(f"{root}/step-10/manifest.json")
    assert fs.exists(f"{root}/step-10/.metadata")

    manager = object.__new__(ObjckptCheckpointManager)  # only what _find_load_step reads
    manager.folder = folder
    manager.storage_options = s3_bucket.storage_options
    assert manager._find_load_step() == 1
    assert manager._find_load_step(s3_bucket.url("nothing-here")) == -1


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_titan_saves_to_s3_and_resumes(tmp_path: Path, async_mode: str) -> None:
    """Run 1 trains 2 steps and commits step-1 and step-2 through objckpt; run 2 loads
    step 2 through ObjectStoreReader, starts at step 3 and commits 3 and 4. Synchronous
    saves are also checked against an uninterrupted run: the same loss at every step."""
    cmd = [sys.executable, str(BENCH / "titan_run.py"), "--workdir", str(tmp_path)]
    cmd += ["--nproc", "2", "--steps1", "2", "--steps2", "4", "--async-mode", async_mode]
    if async_mode != "disabled":
        cmd.append("--no-reference")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert "OK: saved steps 1..2" in done.stdout
    assert "Loading the checkpoint from s3://titan/run/checkpoint/step-2." in done.stdout
    assert "Training starts at step 3" in done.stdout
