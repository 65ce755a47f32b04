"""The async plan cache: reuse when the structure is unchanged, never when it changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import count_table_builds, load
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from objckpt import AsyncCheckpointer, ReadOptions
from objckpt.pipeline.plan_cache import PlanCacheStats
from objckpt.testing.plugin import StoreTarget


def _state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((4, 8), float(step)), "b": torch.arange(8) + step},
        "optim": {
            "lr": 0.1 * step,
            "moments": [torch.full((2,), float(step + i)) for i in range(2)],
        },
        "step": step,
    }


@pytest.fixture
def target(tmp_path) -> StoreTarget:
    return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts DCP local planning calls (a cache hit makes none)."""
    calls: list[int] = []
    original = DefaultSavePlanner.create_local_plan

    def counting(self: DefaultSavePlanner) -> Any:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", counting)
    return calls


def _roundtrip(ckpt: AsyncCheckpointer, state: dict[str, Any], url: str, target) -> str:
    manifest = ckpt.save(state, url).result(timeout=120)
    assert manifest is not None
    got = empty_like_state(state)
    load(got, url, target)
    assert_state_equal(got, state)
    return manifest.attempt


def test_unchanged_structure_reuses_the_plan(target: StoreTarget, planned: list[int]) -> None:
    with AsyncCheckpointer() as ckpt:
        attempts = {_roundtrip(ckpt, _state(s), target.url(f"step-{s}"), target) for s in range(4)}
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=3, misses=1)
    assert len(planned) == 1  # DCP planned the first save only
    assert len(attempts) == 4  # every save its own attempt id


def _shape(s: dict[str, Any]) -> None:
    s["model"]["w"] = torch.ones(5, 8)


def _dtype(s: dict[str, Any]) -> None:
    s["model"]["b"] = s["model"]["b"].to(torch.int32)


def _new_key(s: dict[str, Any]) -> None:
    s["model"]["extra"] = torch.ones(3)


def _dropped_key(s: dict[str, Any]) -> None:
    del s["model"]["b"]


def _value_to_tensor(s: dict[str, Any]) -> None:
    s["optim"]["lr"] = torch.tensor(0.5)


def _list_length(s: dict[str, Any]) -> None:
    s["optim"]["moments"] = [torch.ones(2) * i for i in range(3)]


def _renamed(s: dict[str, Any]) -> None:
    s["model"]["w2"] = s["model"].pop("w")


@pytest.mark.parametrize(
    "change", [_shape, _dtype, _new_key, _dropped_key, _value_to_tensor, _list_length, _renamed]
)
def test_changed_structure_plans_again(
    change: Callable[[dict[str, Any]], None], target: StoreTarget, planned: list[int]
) -> None:
    with AsyncCheckpointer() as ckpt:
        _roundtrip(ckpt, _state(1), target.url("a"), target)
        changed = _state(2)
        change(changed)
        _roundtrip(ckpt, changed, target.url("b"), target)  # loads with the new structure
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=0, misses=2)
        again = _state(3)
        change(again)
        _roundtrip(ckpt, again, target.url("c"), target)
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=1, misses=2)
    assert len(planned) == 2


def test_a_refused_save_keeps_the_cache(target: StoreTarget) -> None:
    with AsyncCheckpointer() as ckpt:
        _roundtrip(ckpt, _state(1), target.url("a"), target)
        with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
            ckpt.save(_state(2), target.url("a"), exists=True)  # refused before agreeing
        _roundtrip(ckpt, _state(3), target.url("b"), target)
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=1, misses=1)


@pytest.fixture
def queued_on(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread each save's uploads were queued on."""
    from objckpt.pipeline.deferred import DeferredWriter

    threads: list[str] = []
    original = DeferredWriter._queue

    def recording(self: DeferredWriter, *args: Any, **kwargs: Any) -> None:
        import threading

        threads.append(threading.current_thread().name)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DeferredWriter, "_queue", recording)
    return threads


class _Box:
    """A picklable value the caller may mutate after ``save()`` returned."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Box) and other.n == self.n


def test_a_hit_queues_uploads_after_save_returns_and_later_changes_are_not_saved(
    target: StoreTarget, queued_on: list[str]
) -> None:
    """On a hit the uploads are framed and queued by the commit thread, not in the
    stall; what the caller changes once ``save()`` returned (tensors in place, a
    mutable non-tensor value) is not in the checkpoint."""
    with AsyncCheckpointer() as ckpt:
        first = {**_state(1), "box": _Box(1)}
        ckpt.save(first, target.url("miss")).result(timeout=120)
        state = {**_state(2), "box": _Box(2)}
        expected = {**_state(2), "box": _Box(2)}
        handle = ckpt.save(state, target.url("hit"))
        state["model"]["w"].add_(100)
        state["optim"]["moments"][0].zero_()
        state["box"].n = 99
        handle.result(timeout=120)
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=1, misses=1)
    assert queued_on[0] == "MainThread"
    assert queued_on[1].startswith("objckpt-commit-")
    got = empty_like_state(expected)
    got["box"] = None
    load(got, target.url("hit"), target, read=ReadOptions(trust_pickles=True))
    assert_state_equal({k: v for k, v in got.items() if k != "box"}, _state(2))
    assert got["box"] == _Box(2)


def test_a_queueing_error_after_save_returned_fails_the_save_and_commits_nothing(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from objckpt.dcp.serialize import Framer
    from objckpt.format.layout import MANIFEST_KEY

    with AsyncCheckpointer() as ckpt:
        ckpt.save(_state(1), target.url("miss")).result(timeout=120)

        def broken(self: Framer, tensor: torch.Tensor) -> Any:
            raise RuntimeError("framing broke")

        monkeypatch.setattr(Framer, "frame", broken)
        handle = ckpt.save(_state(2), target.url("hit"))  # returns: nothing queued yet
        with pytest.raises(RuntimeError, match="framing broke"):
            handle.result(timeout=120)
        with pytest.raises(RuntimeError, match="framing broke"):
            ckpt.check_for_errors()
    assert (tmp_path / "root" / "miss" / MANIFEST_KEY).exists()
    assert not (tmp_path / "root" / "hit" / MANIFEST_KEY).exists()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        **state,
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": {**state["optim"], "moments": [m.clone() for m in state["optim"]["moments"]]},
    }


def _save_then_change(ckpt: AsyncCheckpointer, state: dict[str, Any], url: str, target) -> None:
    """Save ``state``, change its tensors in place once ``save()`` returned, and check
    that the checkpoint holds the values of the call."""
    expected = _snapshot(state)
    handle = ckpt.save(state, url)
    state["model"]["w"].add_(100)
    state["optim"]["moments"][1].zero_()
    handle.result(timeout=120)
    got = empty_like_state(expected)
    load(got, url, target)
    assert_state_equal(got, expected)


def test_a_hit_after_tensors_moved_saves_the_new_tensors_not_the_old_memory(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit reuses the staging set and its piece table; tensors that kept their
    layout but not their memory (a rebound ``.data``, a replaced optimizer state) are
    copied from where they are now, and changes after ``save()`` returned are never
    saved, whether the table was reused or rebuilt."""

    built = count_table_builds(monkeypatch)
    with AsyncCheckpointer() as ckpt:
        state = _state(1)
        _save_then_change(ckpt, state, target.url("s1"), target)
        _save_then_change(ckpt, state, target.url("s2"), target)  # the same tensors
        assert len(built) == 1  # copied by the first save's table
        state["model"]["w"].data = torch.full((4, 8), 30.0)
        state["optim"]["moments"][1] = torch.full((2,), 31.0)
        _save_then_change(ckpt, state, target.url("s3"), target)
        assert len(built) == 2  # the moved tensors were seen
        assert ckpt.plan_cache_stats == PlanCacheStats(hits=2, misses=1)
