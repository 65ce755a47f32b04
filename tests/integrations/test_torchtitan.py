"""torchtitan 0.3.0's own trainer and CheckpointManager, saving to objckpt on s3:// (moto).

torchtitan is not in objckpt's test environment; these run in a venv that has it
(``make test-titan`` builds one and runs them there, as CI does) and skip elsewhere,
or fail where ``OBJCKPT_REQUIRE_TITAN=1`` (that target sets it). The end-to-end test
runs ``bench/titan_run.py``: the llama3 debug model, 2 ranks, gloo on CPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import objckpt
from objckpt.testing.plugin import StoreTarget

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture
def titan() -> None:
    """Skips without torchtitan and a torch it runs on; fails instead where
    ``OBJCKPT_REQUIRE_TITAN=1`` (``make test-titan``), so CI cannot pass by skipping."""
    if importlib.util.find_spec("torchtitan") is None:
        reason = "torchtitan 0.3.0 is not installed (`make test-titan` runs these in a venv)"
    elif not hasattr(torch.distributed, "set_timeout"):
        reason = (
            f"torch {torch.__version__} lacks torch.distributed.set_timeout, which "
            "torchtitan 0.3.0 calls (2.15.0 has it; see guides/torchtitan.md)"
        )
    else:
        return
    if os.environ.get("OBJCKPT_REQUIRE_TITAN", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason} (required here: OBJCKPT_REQUIRE_TITAN is set)")
    pytest.skip(reason)


def test_guide_shows_the_tested_module() -> None:
    """What the guide tells a user to write is the module these tests run."""
    module = (BENCH / "titan_objckpt.py").read_text()
    guide = (ROOT / "docs" / "guides" / "torchtitan.md").read_text()
    assert module[module.index("import dataclasses") :] in guide


def _manager_class() -> type:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from titan_objckpt import ObjckptCheckpointManager

    return ObjckptCheckpointManager


@pytest.mark.usefixtures("titan")
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

    manager = object.__new__(_manager_class())  # only what _find_load_step reads
    manager.folder = folder
    manager.storage_options = s3_bucket.storage_options
    assert manager._find_load_step() == 1
    assert manager._find_load_step(s3_bucket.url("nothing-here")) == -1


@pytest.mark.usefixtures("titan")
@pytest.mark.timeout(1200)  # three or two torchtitan jobs of ~25 s each on an idle machine
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_titan_saves_to_s3_and_resumes(tmp_path: Path, async_mode: str) -> None:
    """Run 1 trains 2 steps and commits step-1 and step-2 through objckpt; run 2 loads
    step 2 through ObjectStoreReader, starts at step 3 and commits 3 and 4. Synchronous
    saves are also checked against an uninterrupted run: the same loss at every step."""
    cmd = [sys.executable, str(BENCH / "titan_run.py"), "--workdir", str(tmp_path)]
    cmd += ["--nproc", "2", "--steps1", "2", "--steps2", "4", "--async-mode", async_mode]
    if async_mode != "disabled":
        cmd.append("--no-reference")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert "OK: saved steps 1..2" in done.stdout
    assert "Loading the checkpoint from s3://titan/run/checkpoint/step-2." in done.stdout
    assert "Training starts at step 3" in done.stdout
