"""Functions the worker-pool tests run in worker processes (importable, torch-free,
so a worker that runs them still has not imported torch)."""

from __future__ import annotations

import os
import sys
import time


def loaded_modules() -> list[str]:
    return sorted(sys.modules)


def echo(value: object) -> object:
    return value


def fail(message: str) -> None:
    raise ValueError(message)


def hold(started: str, release: str, timeout: float = 120.0) -> int:
    """Say it started (a file), then wait for the test's release file."""
    with open(started, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + timeout
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()
