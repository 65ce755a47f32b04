"""The scan's layout: one flat tuple that tells apart every change a plan depends on,
and costs the garbage collector nothing per tensor (#47)."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import torch

from objckpt.pipeline.state_walk import rebuild, scan


class _Sub(torch.Tensor):
    pass


def _states() -> dict[str, Any]:
    """State dicts that must plan differently, including pairs whose paths agree and
    only a recorded container length tells apart."""
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
        # pairs whose paths agree: only a container's length tells them apart
        "nested b": {"x": {"a": {"b": t}}},
        "empty a, dotted b": {"x": {"a": {}, "a.b": t}},
        "list of one": {"x": {"a": [t]}},
        "empty list, indexed key": {"x": {"a": [], "a[0]": t}},
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


def test_the_layout_holds_no_tracked_object_per_tensor() -> None:
    # A tuple (and a torch.Size) per tensor in the layout was ~28 young collections per
    # save at 10,000 tensors, and fed the full collections that landed in the stall.
    state = {
        "model": {f"layer{i}.weight": torch.zeros(2, 2) for i in range(500)},
        "optim": [torch.nn.Parameter(torch.zeros(3)) for _ in range(500)],
        "extra": (torch.zeros(1).as_subclass(_Sub), 7),
    }
    layout, tensors, _ = scan(state)
    assert len(tensors) == 1_001
    tracked = [x for x in layout if gc.is_tracked(x) and not isinstance(x, type)]
    assert tracked == [], f"the layout holds {len(tracked)} tracked objects"


class _Mesh:
    def __init__(self, ranks: list[int]) -> None:
        self.mesh = torch.tensor(ranks)
        self.device_type = "cpu"


class _FakeDTensor(torch.Tensor):
    """What the scan reads of a DTensor: its local shard, mesh and placements."""

    device_mesh: _Mesh
    placements: tuple[str, ...]

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)[:2]


def _sharded(mesh: _Mesh, placements: tuple[str, ...], rows: int = 4) -> torch.Tensor:
    d = torch.zeros(rows, 3).as_subclass(_FakeDTensor)
    d.device_mesh, d.placements = mesh, placements
    return d


def test_dtensors_scan_by_mesh_placements_and_global_shape() -> None:
    one, other = _Mesh([0, 1]), _Mesh([0, 2])
    base = {"a": _sharded(one, ("Shard(0)",)), "b": _sharded(one, ("Shard(0)",))}
    layout, tensors, _ = scan(base)
    assert [tuple(t.shape) for t in tensors] == [(2, 3), (2, 3)]  # the local shards
    changes = {
        "mesh": {"a": _sharded(one, ("Shard(0)",)), "b": _sharded(other, ("Shard(0)",))},
        "placements": {"a": _sharded(one, ("Shard(0)",)), "b": _sharded(one, ("Replicate()",))},
        "global shape": {"a": _sharded(one, ("Shard(0)",)), "b": _sharded(one, ("Shard(0)",), 5)},
        "plain": {"a": _sharded(one, ("Shard(0)",)), "b": torch.zeros(2, 3)},
    }
    for name, state in changes.items():
        assert scan(state)[0] != layout, name
    again = {"a": _sharded(one, ("Shard(0)",)), "b": _sharded(one, ("Shard(0)",))}
    assert scan(again)[0] == layout
