"""A training process killed with SIGKILL leaves no upload workers and no staging memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from objckpt.pipeline import lifeline
from objckpt.pipeline.segment import SHM_DIR
from objckpt.pipeline.stage import Stager

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from objckpt import AsyncCheckpointer, AsyncOptions

    root, report = sys.argv[1], sys.argv[2]
    if __name__ == "__main__":
        ckpt = AsyncCheckpointer(async_options=AsyncOptions(workers=2))
        ckpt.save({"w": torch.randn(1 << 16)}, f"file://{root}/c1").result(timeout=120)
        workers = ckpt.worker_pids
        segments = [b.segment.path for b in ckpt._stager._all]
        with open(report + ".tmp", "w") as f:
            json.dump({"workers": workers, "segments": segments}, f)
        os.replace(report + ".tmp", report)
        time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def _wait_until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to watch processes")
def test_sigkilled_training_process_takes_its_workers_and_segments(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(report)])
    try:
        assert _wait_until(report.exists, 120), "the child never finished its save"
        seen = json.loads(report.read_text())
        # the pool starts workers as work arrives: one or two here
        assert seen["workers"] and seen["segments"]
        assert all(not _gone(pid) for pid in seen["workers"])
        assert all(os.path.exists(p) for p in seen["segments"])
        child.send_signal(signal.SIGKILL)  # the training process only, as the OOM killer does
        child.wait(timeout=30)
        assert _wait_until(lambda: all(_gone(pid) for pid in seen["workers"]), 30), seen
        assert _wait_until(lambda: not any(os.path.exists(p) for p in seen["segments"]), 30)
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.skipif(SHM_DIR is None, reason="no /dev/shm")
def test_new_stager_sweeps_segments_of_exited_processes() -> None:
    assert SHM_DIR is not None
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    ns = lifeline.segment_prefix().split("-")[1]
    stale = Path(SHM_DIR, f"objckpt-{ns}-{exited.pid}-stale")
    mine = Path(SHM_DIR, f"{lifeline.segment_prefix()}live")
    other_namespace = Path(SHM_DIR, f"objckpt-{int(ns) + 1}-{exited.pid}-foreign")
    for p in (stale, mine, other_namespace):
        p.write_bytes(b"x" * 16)
    try:
        Stager().close()
        assert not stale.exists()
        assert mine.exists() and other_namespace.exists()
    finally:
        for p in (stale, mine, other_namespace):
            p.unlink(missing_ok=True)
