"""Named states that several test modules save, beside ``conftest.sample_state``.

A test that needs a state of its own keeps it; a state two modules built the same
way lives here once, so that what "the state of step N" means is one definition.
"""

from __future__ import annotations

from typing import Any

import torch


def stepped_state(step: int, shape: tuple[int, ...] = (64, 64)) -> dict[str, Any]:
    """A small state whose every value says which step wrote it: a load of the wrong
    step (a fallback, a rollback, a retried commit) fails the comparison."""
    return {"w": torch.full(shape, float(step)), "b": torch.arange(9) * step, "step": step}


def counting_state(n: int = 4096) -> dict[str, Any]:
    """One float32 tensor of ``n`` known elements and a plain value: the smallest state
    whose bytes a crafted or slow read can be checked against."""
    return {"w": torch.arange(n, dtype=torch.float32), "step": 3}
