"""Benchmarks never rot (#45 item 2): every entry point of bench/ runs in ``make test``.

A benchmark is run by hand, rarely, so a rename in objckpt broke ``bench_scale.py
--commit-worlds 64`` (``scale_commit`` still built the commit's writer with
``writer=``) and nothing noticed. Here each entry point runs once with ``--smoke``
(tiny sizes, one run, results in a temporary directory: ``bench/smoke.py``) as a
subprocess, the way a person runs it, so a break fails CI. Each starts the servers it
needs itself (a moto server starts in well under a second; the benchmarks reset their
own server between runs, which the session's shared one must not be). A peer that is
not installed (the ``bench`` extra), a GPU or torchtitan is skipped by the script with
a logged line. No figure is checked: smoke runs measure nothing.

A second test fails when a file of bench/ is neither run here nor named as what a
smoke run covers, so a new benchmark cannot skip this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"

#: Every benchmark entry point, with the arguments of its smoke run besides --smoke.
SMOKE: dict[str, list[str]] = {
    "bench_async.py": [],
    "bench_async_memory.py": [],
    "bench_azure.py": [],
    "bench_compress.py": [],
    "bench_cuda.py": [],  # says "no CUDA device" and exits 0 where there is none
    "bench_faults.py": [],
    "bench_gcs.py": [],
    "bench_prefixes.py": [],  # throttled through the partition model at tiny rates
    "bench_reuse.py": [],
    "bench_scale.py": ["--commit-worlds", "64"],  # rank 0's commit (scale_commit.py)
    "bench_sync.py": [],
    # The cold group runs cold_save.py per save. The equal-tensor state, as its
    # default one (bench_sync's transformer_state) is smoke-run by bench_async.py.
    "bench_throughput.py": ["--equal-tensors", "4"],
    "bench_tiers.py": [],
    "bench_transport.py": [],  # objckpt's side only where obstore is missing
    "titan_run.py": [],  # skipped (a logged line) where torchtitan is missing
}

#: The other files of bench/: what each is, and which smoke runs run its code.
COVERED_BY: dict[str, str] = {
    "cold.py": "bench_throughput.py (its cold group)",
    "cold_save.py": "bench_throughput.py (a subprocess per cold save)",
    "proc_stats.py": "bench_throughput.py, bench_async_memory.py",
    "record.py": "every smoke run (it writes each result file)",
    "scale_commit.py": "bench_scale.py --commit-worlds 64",
    "smoke.py": "every smoke run (the --smoke mode itself)",
    "titan_objckpt.py": "titan_run.py, where torchtitan is installed (make test-titan)",
    "gpu_check.sh": "bench_cuda.py (the GPU machine's script; runs no smoke)",
}


def _results() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in RESULTS.iterdir()}


def _env() -> dict[str, str]:
    """The checkout's objckpt and bench/ first (an installed objckpt may be another
    tree's), quiet offline clients."""
    paths = [str(ROOT), str(BENCH), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smoke(script: str, tmp_path: Path) -> None:
    before = _results()
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *SMOKE[script]],
        cwd=tmp_path,  # a relative default --out would land here, not in bench/results
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{script} --smoke failed (exit {proc.returncode}):\n{log}"
    assert _results() == before, f"{script} --smoke wrote to bench/results"
    assert not any(tmp_path.iterdir()), f"{script} --smoke wrote into its working directory"


def test_every_bench_file_is_smoke_run_or_covered() -> None:
    files = {p.name for p in BENCH.iterdir() if p.is_file()}
    unknown = sorted(files - set(SMOKE) - set(COVERED_BY))
    assert not unknown, (
        f"bench/ files with no smoke run: {unknown}; give each entry point a --smoke mode "
        "(bench/smoke.py) and add it to SMOKE, or say in COVERED_BY which smoke run covers it"
    )
    gone = sorted((set(SMOKE) | set(COVERED_BY)) - files)
    assert not gone, f"listed here but not in bench/: {gone}"
    for name in SMOKE:
        text = (BENCH / name).read_text()
        assert 'if __name__ == "__main__":' in text, f"{name} is no entry point"
        assert "smoke.add_argument(" in text, f"{name} takes no --smoke"
    for name in COVERED_BY:
        if name.endswith(".py") and 'if __name__ == "__main__":' in (BENCH / name).read_text():
            # An entry point of its own (cold_save.py, run by bench_throughput.py): its
            # runner must be a smoke run.
            assert COVERED_BY[name].split()[0] in SMOKE, name
