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
