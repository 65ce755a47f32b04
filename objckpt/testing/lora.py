"""A LoRA-shaped state dict, for the reuse tests and ``bench/bench_reuse.py``.

What a fine-tuning job checkpoints: a frozen base of fp32 weights that never change,
small low-rank adapters that train, and the optimizer's state for the adapters only
(Adam's moments and step count). One definition, so the tests' figures and the
benchmark's measure the same shape.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["lora_state", "lora_step"]


def lora_state(layers: int, width: int, rank: int) -> dict[str, Any]:
    """``layers`` frozen ``width`` x ``width`` weights, each with adapters of ``rank``
    and their Adam moments (all zero until :func:`lora_step`)."""
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, torch.Tensor] = {}
    for n in range(layers):
        model[f"layers.{n}.weight"] = torch.randn(width, width, generator=g)
        for name, shape in (
            (f"layers.{n}.lora_a", (rank, width)),
            (f"layers.{n}.lora_b", (width, rank)),
        ):
            model[name] = torch.zeros(shape)
            moments[f"{name}.exp_avg"] = torch.zeros(shape)
            moments[f"{name}.exp_avg_sq"] = torch.zeros(shape)
    return {"model": model, "optim": {"state": moments, "step": 0}}


def lora_step(state: dict[str, Any], step: int) -> None:
    """One step of training: the adapters and their optimizer state change, the base not."""
    g = torch.Generator().manual_seed(step)
    for name, value in state["model"].items():
        if "lora" in name:
            value.add_(torch.randn(value.shape, generator=g) * 0.01)
    for value in state["optim"]["state"].values():
        value.add_(torch.rand(value.shape, generator=g))
    state["optim"]["step"] = step
