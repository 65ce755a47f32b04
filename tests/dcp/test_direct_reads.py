"""A load writes tensors' bytes straight into their targets (issue #47, CPU per byte).

A framed tensor read whole into a CPU target of its dtype and shape, contiguous, is
fetched into the target's own memory and checked there; every other read goes
through scratch and a copy, as before. These tests pin both sides of that line and
that the checks did not move: the checksum still refuses a flipped bit, an
unexpected frame is still read the general way, and the spans a range is cut into
(:class:`~objckpt.writers.reads.SpanSink`) put each byte where it belongs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_state_equal
from helpers import load, save

from objckpt.dcp.serialize import Framer
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.reads import SpanSink

#: float32 elements of the smallest tensor a load places directly (64 KiB).
DIRECT = 16 * 1024


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(4 * DIRECT, generator=g),
        "half": torch.randn(2 * DIRECT, generator=g).to(torch.bfloat16),
        "square": torch.randn(256, 256, generator=g),
        "small": torch.arange(10.0),
    }


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The element counts of every ``Tensor.copy_`` from now on."""
    seen: list[int] = []
    real = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(self.numel())
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    return seen


def test_tensors_read_whole_land_in_their_targets_without_a_copy(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the small tensor is copied out of fetched bytes; the others are fetched
    into the targets the state dict holds (the same memory, loaded right)."""
    state = _state()
    url = s3_bucket.url("direct")
    save(state, url, s3_bucket)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    where = {k: v.data_ptr() for k, v in got.items()}
    copied = _copies(monkeypatch)
    load(got, url, s3_bucket)
    monkeypatch.undo()
    assert_state_equal(got, state)
    assert {k: v.data_ptr() for k, v in got.items()} == where
    assert copied and max(copied) < DIRECT, copied  # "small" alone


def test_targets_that_cannot_take_bytes_directly_are_loaded_through_a_copy(
    store: StoreTarget,
) -> None:
    """A transposed target, a target of another dtype and two names sharing one
    tensor are each loaded right, on every store family."""
    state = _state()
    state["tied"] = state["big"].clone()
    url = store.url("indirect")
    save(state, url, store)
    got: dict[str, torch.Tensor] = {
        "big": torch.zeros(4 * DIRECT),
        "half": torch.zeros(2 * DIRECT, dtype=torch.float32),  # stored as bfloat16
        "square": torch.zeros(256, 256).t(),  # not contiguous
        "small": torch.zeros(10),
    }
    got["tied"] = got["big"]  # the same memory under two names
    load(got, url, store)
    assert torch.equal(got["big"], state["big"])
    assert torch.equal(got["half"], state["half"].float())
    assert not got["square"].is_contiguous() and torch.equal(got["square"], state["square"])
    assert torch.equal(got["small"], state["small"])


def test_a_frame_other_than_expected_is_read_the_general_way(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes placed in a target whose frame turns out not to be the one this torch
    writes are reassembled and read with ``torch.load``, not taken as they lie."""
    state = _state()
    url = s3_bucket.url("frames")
    save(state, url, s3_bucket)
    real = Framer.frame_for
    asked: list[tuple[int, ...]] = []

    def other(self: Framer, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        frame = real(self, dtype, shape)
        if frame is None:
            return None
        asked.append(shape)
        head, tail = frame
        return head[:-1] + bytes([head[-1] ^ 0xFF]), tail  # same length, other bytes

    monkeypatch.setattr(Framer, "frame_for", other)
    loaded: list[int] = []
    real_load = torch.load

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        out = real_load(*args, **kwargs)
        loaded.append(out.numel() if isinstance(out, torch.Tensor) else 0)
        return out

    monkeypatch.setattr(torch, "load", counting_load)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, url, s3_bucket)
    assert asked  # the load did place with the frame it expected
    # Every tensor went through torch.load, the three placed ones included.
    assert sorted(n for n in loaded if n >= DIRECT) == [2 * DIRECT, 4 * DIRECT, 256 * 256]
    assert_state_equal(got, state)


def test_a_span_sink_puts_each_byte_in_its_buffer() -> None:
    """Writes cross buffer edges; a window is a piece of the same span; a write past
    the end is refused before anything is written."""
    a, b, c = bytearray(3), bytearray(4), bytearray(5)
    sink = SpanSink([memoryview(a), memoryview(b), memoryview(c)])
    assert len(sink) == 12
    sink.write(2, b"ABCDEF")  # the end of a, all of b, the start of c
    piece = sink.window(8, 4)
    piece.write(1, memoryview(b"xyz"))
    assert bytes(a + b + c) == b"\0\0ABCDEF\0xyz"
    with pytest.raises(ValueError):
        piece.write(2, b"abc")
    with pytest.raises(ValueError):
        sink.window(10, 3)
    assert bytes(a + b + c) == b"\0\0ABCDEF\0xyz"
