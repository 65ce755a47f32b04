"""Background staging: save() returns before the copy; a tensor changed too early fails it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import load

from objckpt import AsyncCheckpointer, AsyncOptions, CheckpointManager
from objckpt.errors import ConfigurationError, StateDictError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.pipeline.host_copy import HostCopier
from objckpt.testing.plugin import StoreTarget

OPTIONS = AsyncOptions(background_staging=True)


def _state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(step)), "b": torch.arange(64.0) + step},
        "optim": {"m": torch.full((64,), -float(step)), "step": step},
    }


@pytest.fixture
def target(tmp_path) -> StoreTarget:
    return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})


class _Gate:
    """Holds every staging copy until opened; records the thread each copy ran on."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.threads: list[str] = []


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    # Both ways into staging: a copy, and a foreground copy by a reused piece table.
    for name in ("copy", "copy_reusing"):
        real = getattr(HostCopier, name)

        def gated(self: HostCopier, *args: Any, real: Any = real) -> Any:
            g.threads.append(threading.current_thread().name)
            if threading.current_thread() is not threading.main_thread():
                assert g.open.wait(60), "the test never opened the gate"
            return real(self, *args)

        monkeypatch.setattr(HostCopier, name, gated)
    yield g
    g.open.set()


def test_save_returns_before_the_copy_and_saves_the_values_of_the_call(
    target: StoreTarget, gate: _Gate
) -> None:
    with AsyncCheckpointer(async_options=OPTIONS) as ckpt:
        first = ckpt.save(_state(1), target.url("s1"))  # a first plan copies in the call
        assert gate.threads == ["MainThread"] and first.wait_staged(timeout=0)
        first.result(timeout=120)
        state = _state(2)
        handle = ckpt.save(state, target.url("s2"))
        # save() returned while the copy is held at the gate, on the commit thread
        assert not handle.wait_staged(timeout=0)
        gate.open.set()
        assert handle.wait_staged(timeout=60)
        assert gate.threads[1].startswith("objckpt-commit-")
        state["model"]["w"].add_(1000)  # after wait_staged: not part of the save
        assert handle.result(timeout=120) is not None
    got = empty_like_state(_state(0))
    got["optim"]["step"] = None
    load(got, target.url("s2"), target)
    assert_state_equal(got, _state(2))


def test_a_tensor_changed_before_the_copy_fails_the_save_and_commits_nothing(
    target: StoreTarget, gate: _Gate, tmp_path
) -> None:
    with AsyncCheckpointer(async_options=OPTIONS) as ckpt:
        ckpt.save(_state(1), target.url("s1")).result(timeout=120)
        state = _state(2)
        handle = ckpt.save(state, target.url("s2"))
        state["optim"]["m"].mul_(2)  # an optimizer step that did not wait_staged()
        gate.open.set()
        with pytest.raises(StateDictError, match=r"changed in place.*'optim\.m'.*wait_staged"):
            handle.result(timeout=120)
        with pytest.raises(StateDictError):
            ckpt.check_for_errors()
        # the next save (state unchanged since its call) goes through
        ckpt.save(_state(3), target.url("s3")).result(timeout=120)
    assert not (tmp_path / "root" / "s2" / MANIFEST_KEY).exists()
    assert (tmp_path / "root" / "s3" / MANIFEST_KEY).exists()


def test_without_background_staging_save_returns_staged(target: StoreTarget, gate: _Gate) -> None:
    gate.open.set()
    with AsyncCheckpointer() as ckpt:
        for step in (1, 2):
            handle = ckpt.save(_state(step), target.url(f"s{step}"))
            assert handle.wait_staged(timeout=0)
            handle.result(timeout=120)
    assert gate.threads == ["MainThread", "MainThread"]


def test_manager_wait_staged_lets_the_loop_change_the_state(
    target: StoreTarget, gate: _Gate
) -> None:
    gate.open.set()
    root = target.url("run")
    state = _state(0)
    with CheckpointManager(
        root, storage_options=target.storage_options, async_options=OPTIONS
    ) as mgr:
        for step in (1, 2, 3):
            state["model"]["w"].fill_(step)  # this step's update
            state["optim"]["step"] = step
            mgr.save(step, state)
            mgr.wait_staged()
            state["model"]["w"].add_(0.5)  # the next step's update starts: after the copy
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]
        got = empty_like_state(_state(0))
        got["optim"]["step"] = None
        assert mgr.load(got) == 3
    assert torch.equal(got["model"]["w"], torch.full((64, 64), 3.0))
    assert got["optim"]["step"] == 3


def test_the_option_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="background_staging='yes'"):
        AsyncOptions(background_staging="yes")  # type: ignore[arg-type]
