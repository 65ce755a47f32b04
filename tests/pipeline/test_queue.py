"""AsyncRequest / AsyncCallsQueue semantics (single process; cross-rank in test_distributed)."""

from __future__ import annotations

import threading

import pytest

from objckpt import AsyncCallsQueue, AsyncRequest
from objckpt.errors import ObjckptError


def test_requests_finalize_in_order_once() -> None:
    log: list[str] = []
    gate = threading.Event()
    queue = AsyncCallsQueue()
    first = queue.schedule_async_request(AsyncRequest(gate.wait, (10,), [lambda: log.append("f0")]))
    second = queue.schedule_async_request(
        AsyncRequest(None, (), [lambda: log.append("f1a"), lambda: log.append("f1b")])
    )
    assert (first, second) == (0, 1)
    assert queue.get_num_unfinalized_calls() == 2
    assert queue.maybe_finalize_async_calls() == []  # the first is still running; order holds
    gate.set()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert log == ["f0", "f1a", "f1b"]
    assert queue.maybe_finalize_async_calls(blocking=True) == []
    assert log == ["f0", "f1a", "f1b"]
    queue.close()


def test_scheduled_request_is_frozen() -> None:
    request = AsyncRequest(None, (), [])
    request.add_finalize_fn(lambda: None)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    with pytest.raises(ObjckptError, match="already scheduled"):
        request.add_finalize_fn(lambda: None)
    queue.close()


def test_failed_request_raises_and_skips_its_finalizers() -> None:
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("upload failed")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(boom, (), [lambda: ran.append(0)]))
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: ran.append(1)]))
    with pytest.raises(RuntimeError, match="upload failed"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert ran == [1]
    queue.close()


def test_close_finalizes_everything() -> None:
    ran: list[int] = []
    queue = AsyncCallsQueue()
    for i in range(3):
        queue.schedule_async_request(AsyncRequest(lambda: None, (), [lambda i=i: ran.append(i)]))
    queue.close()
    assert ran == [0, 1, 2] and queue.get_num_unfinalized_calls() == 0


def test_a_save_request_is_the_checkpointers_save_finalized_after_its_commit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The queue is an adapter over AsyncCheckpointer: a save's request runs nothing on
    the queue's executor; its finalize functions run once the save has committed."""
    import torch

    from objckpt import AsyncCheckpointer, AsyncOptions
    from objckpt.errors import CheckpointExistsError
    from objckpt.format.layout import MANIFEST_KEY

    url = f"file://{tmp_path}/ck"
    seen: list[bool] = []
    with AsyncCheckpointer(async_options=AsyncOptions(workers=1)) as ckpt:
        queue = AsyncCallsQueue()
        request = ckpt.async_request(
            {"w": torch.ones(8)},
            url,
            finalize_fns=[lambda: seen.append((tmp_path / "ck" / MANIFEST_KEY).exists())],
        )
        assert request.save is not None and request.async_fn is None
        assert queue.schedule_async_request(request) == 0
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert seen == [True]  # committed before the finalize function ran
        # A save that fails is raised by the finalize, its functions never run.
        again = ckpt.async_request(
            {"w": torch.ones(8)}, url, finalize_fns=[lambda: seen.append(False)]
        )
        queue.schedule_async_request(again)
        with pytest.raises(CheckpointExistsError):
            queue.maybe_finalize_async_calls(blocking=True)
        assert seen == [True] and queue.get_num_unfinalized_calls() == 0
        queue.close()
