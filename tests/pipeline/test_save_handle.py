"""SaveHandle's lifecycle, given at construction: end hooks, tier, promotion, time bound."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from objckpt.format.manifest import Manifest
from objckpt.pipeline.handle import EndHook, SaveHandle, SaveLifecycle


def test_end_hooks_run_in_order_before_the_handle_reports_done() -> None:
    future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
    seen: list[tuple[str, bool, BaseException | None]] = []

    def hook(name: str) -> EndHook:
        return lambda h, exc: seen.append((name, h.done(), exc))

    handle = SaveHandle(
        "file:///tmp/x", future, lifecycle=SaveLifecycle(on_end=(hook("a"), hook("b")))
    )
    assert not handle.done()
    future.set_result(None)
    assert handle.done()
    assert seen == [("a", False, None), ("b", False, None)]
    assert handle.result() is None


def test_a_failing_hook_is_logged_and_the_next_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
    ran: list[BaseException | None] = []

    def boom(h: SaveHandle, exc: BaseException | None) -> None:
        raise RuntimeError("hook failed")

    handle = SaveHandle(
        "file:///tmp/x",
        future,
        lifecycle=SaveLifecycle(on_end=(boom, lambda h, exc: ran.append(exc))),
    )
    error = OSError("upload failed")
    future.set_exception(error)
    assert ran == [error]
    assert handle.exception() is error
    assert "after the save of file:///tmp/x" in caplog.text


def test_a_local_save_is_durable_once_its_promotion_ends() -> None:
    future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
    promotion: concurrent.futures.Future[None] = concurrent.futures.Future()
    handle = SaveHandle(
        "file:///tmp/x", future, lifecycle=SaveLifecycle(tier="local", promotion=promotion)
    )
    assert handle.tier == "local" and handle.will_be_durable
    future.set_result(None)
    assert handle.seconds_to_durable is None
    promotion.set_result(None)
    assert handle.wait_durable(1.0) is True
    assert handle.seconds_to_durable is not None

    unpromoted = SaveHandle("file:///tmp/y", future, lifecycle=SaveLifecycle(tier="local"))
    assert not unpromoted.will_be_durable and unpromoted.wait_durable(1.0) is False


def test_settled_never_waits_past_the_handles_own_bound() -> None:
    future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
    handle = SaveHandle("file:///tmp/x", future, ends_by=time.monotonic() + 0.05)
    started = time.monotonic()
    assert handle.settled() is False
    assert time.monotonic() - started < 5.0
    future.set_result(None)
    assert handle.settled() is True


@pytest.mark.parametrize("kind", ["primary", "hooks", "local"])
def test_a_finished_handle_and_its_result_are_freed_without_the_cyclic_collector(
    kind: str,
) -> None:
    """A handle's ends kept a bound method of themselves in their future's callbacks:
    a reference cycle that held the committed manifest (30,000 objects at 10,000
    tensors) until the next full collection of the cyclic garbage collector, which
    each save then set off. Freed by reference counting now, once the caller lets go:
    a save to the primary, one with end hooks (the manager's), and a local one with a
    promotion and a replication."""
    import gc
    import weakref

    class Result:  # stands for the manifest (a plain object a weak reference can follow)
        pass

    seen: list[BaseException | None] = []
    lifecycle = {
        "primary": SaveLifecycle(),
        "hooks": SaveLifecycle(on_end=(lambda h, exc: seen.append(exc),)),
        "local": SaveLifecycle(
            tier="local",
            promotion=concurrent.futures.Future(),
            replication=concurrent.futures.Future(),
        ),
    }[kind]
    future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
    handle = SaveHandle("file:///tmp/x", future, lifecycle=lifecycle)
    result = Result()
    gone = weakref.ref(result)
    was = gc.isenabled()
    gc.disable()
    try:
        future.set_result(result)  # type: ignore[arg-type]
        if lifecycle.promotion is not None and lifecycle.replication is not None:
            lifecycle.promotion.set_result(None)
            lifecycle.replication.set_result(True)
            assert handle.seconds_to_durable is not None
        assert handle.result() is result
        assert seen == ([None] if kind == "hooks" else [])
        assert handle.seconds_to_commit is not None  # the end recorded when it was reached
        del lifecycle
        del handle, future, result
        assert gone() is None, "the finished save's result is held by a reference cycle"
    finally:
        if was:
            gc.enable()
