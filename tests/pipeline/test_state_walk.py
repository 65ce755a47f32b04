"""The scan's layout: one flat tuple that tells apart every change a plan depends on,
and costs the garbage collector nothing per tensor (#47)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from objckpt.pipeline.state_walk import rebuild, scan


class _Sub(torch.Tensor):
    pass


def _states() -> dict[str, Any]:
    """State dicts that must plan differently, including the pairs a flattened layout
    could confuse if a field's count were not fixed by what precedes it."""
    t = torch.zeros(6)
    return {
        "base": {"a": t, "b": 1},
        "shape 2x3": {"a": torch.zeros(2, 3), "b": 1},
        "shape 3x2": {"a": torch.zeros(3, 2), "b": 1},
        "dtype": {"a": t.to(torch.float64), "b": 1},
        "parameter": {"a": torch.nn.Parameter(t), "b": 1},
        "subclass": {"a": t.as_subclass(_Sub), "b": 1},
        "value type": {"a": t, "b": 1.0},
        "renamed": {"a": t, "c": 1},
        "reordered": {"b": 1, "a": t},
        "empty dict beside": {"a": t, "b": 1, "c": {}},
        "empty list beside": {"a": t, "b": 1, "c": []},
        "list": {"a": [t], "b": 1},
        "tuple": {"a": (t,), "b": 1},
        "nested dict": {"a": {"x": t}, "b": 1},
        "two in list": {"a": [t, t], "b": 1},
        "list then int": {"a": [t], "b": 1, "c": 2},
        # a path that looks like a field of the entry before it
        "key named like a dtype": {"a": t, "torch.float32": 1},
        "0-d": {"a": torch.zeros(()), "b": 1},
        "1-d of 1": {"a": torch.zeros(1), "b": 1},
    }


def test_every_change_a_plan_depends_on_changes_the_layout() -> None:
    layouts = {name: scan(state)[0] for name, state in _states().items()}
    for (n1, l1), (n2, l2) in itertools.combinations(layouts.items(), 2):
        assert l1 != l2, f"{n1!r} and {n2!r} scan alike"


def test_equal_structures_scan_alike_whatever_the_values() -> None:
    one = {"m": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}, "step": 1, "opt": [torch.ones(2)]}
    two = {"m": {"w": torch.ones(4, 4), "b": torch.ones(4)}, "step": 9, "opt": [torch.zeros(2)]}
    first, second = scan(one), scan(two)
    assert first[0] == second[0] and hash(first[0]) == hash(second[0])
    assert first[2] == second[2] == [".m.w", ".m.b", ".opt[0]"]
    expected = (one["m"]["w"], one["m"]["b"], one["opt"][0])
    assert [t.data_ptr() for t in first[1]] == [t.data_ptr() for t in expected]


def test_rebuild_puts_each_view_where_its_tensor_was() -> None:
    state = {"m": {"w": torch.zeros(2), "b": torch.zeros(3)}, "step": 4, "opt": [torch.ones(1)]}
    _, tensors, _ = scan(state)
    views = [t.clone() + 1 for t in tensors]
    out = rebuild(state, views)
    assert out["m"]["w"] is views[0] and out["m"]["b"] is views[1] and out["opt"][0] is views[2]
    assert out["step"] == 4


@pytest.fixture
def no_collections() -> Iterator[None]:
    """Automatic collections off, so the young generation's count is what the scan
    left allocated (no collection resets it midway)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_the_layout_keeps_no_tracked_object_per_tensor(no_collections: None) -> None:
    # A tuple (and a torch.Size) per tensor in the layout was ~28 young collections per
    # save at 10,000 tensors, and fed the full collections that landed in the stall.
    state = {f"layer{i}.weight": torch.zeros(2, 2) for i in range(2_000)}
    before = gc.get_count()[0]
    layout, tensors, paths = scan(state)
    kept = gc.get_count()[0] - before
    assert len(tensors) == len(paths) == 2_000 and len(layout) > 2_000
    # the three lists, the tuple and a little slack; far below one per tensor
    assert kept < 50, f"the scan left {kept} tracked objects for 2,000 tensors"
