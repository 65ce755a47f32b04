"""A load writes tensors' bytes straight into their targets (issue #47, CPU per byte).

A framed tensor read whole into a plain, contiguous CPU target of its dtype and
shape, through DCP's own planner, whose memory no other read of the load targets,
is fetched into that memory and checked there; every other read goes through
scratch and a copy, as before. These tests pin both sides of that line (a transposed
or cast target, tensors sharing memory, a wrapper subclass without storage of its
own, a planner staging through a buffer of its own) and that the checks did not
move: the checksum still covers a placed tensor's frame, an unexpected frame is read
the general way, and the spans a range is cut into
(:class:`~objckpt.writers.reads.SpanSink`) put each byte where it belongs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_state_equal
from helpers import carried, fs_of, load, path_of, save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils._pytree import tree_map

from objckpt import ObjectStoreReader, ReadOptions
from objckpt.dcp.serialize import Framer
from objckpt.errors import ChecksumMismatchError
from objckpt.format.layout import is_objckpt_payload
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


@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_flipped_bit_in_a_placed_tensors_frame_is_refused(
    s3_bucket: StoreTarget, where: str
) -> None:
    """The CRC32C of a tensor placed in its target covers its frame too: a bit flipped
    in the head or the tail (the object holds this one tensor) is refused by name."""
    state = {"w": torch.randn(4 * DIRECT)}
    url = s3_bucket.url(f"frame-{where}")
    save(state, url, s3_bucket)
    fs = fs_of(s3_bucket)
    (payload,) = [
        p for p in fs.ls(path_of(s3_bucket, url)) if is_objckpt_payload(p.rsplit("/")[-1])
    ]
    data = bytearray(fs.cat_file(payload))
    data[0 if where == "head" else -1] ^= 0x01
    fs.pipe_file(payload, bytes(data))
    with pytest.raises(BaseException) as info:
        load({"w": torch.zeros(4 * DIRECT)}, url, s3_bucket)
    err = carried(info.value)
    assert isinstance(err, ChecksumMismatchError) and "'w'" in str(err), repr(err)


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
    with pytest.raises(ValueError):  # 4 int32 are 16 bytes, not 4
        piece.write(0, memoryview(bytearray(16)).cast("i"))
    assert bytes(a + b + c) == b"\0\0ABCDEF\0xyz"


class _Wrapper(torch.Tensor):
    """A wrapper tensor subclass (as float8 and NF4 tensors are): no storage of its
    own (``data_ptr()`` is 0), its bytes in ``inner``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device, strides=inner.stride()
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.inner if isinstance(x, _Wrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        views = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
        views += (torch.ops.aten.slice.Tensor, torch.ops.aten.view.default)
        return _Wrapper(out) if func in views else out


def test_a_tensor_subclass_target_is_loaded_through_its_own_copy(store: StoreTarget) -> None:
    """A wrapper subclass reports a CPU, contiguous tensor of the right dtype and
    shape, but its memory is elsewhere: its bytes go through its ``copy_``, never to
    its (null) ``data_ptr``."""
    state = {"w": torch.randn(4 * DIRECT)}
    url = store.url("subclass")
    save(state, url, store)
    got = {"w": _Wrapper(torch.zeros(4 * DIRECT))}
    load(got, url, store)
    assert torch.equal(got["w"].inner, state["w"])  # type: ignore[attr-defined]


class _Staging(DefaultLoadPlanner):
    """Hands out one reused buffer as every target and copies it into the state dict
    on commit, as torch's ``LoadPlanner`` contract allows."""

    buffer = torch.empty(8 * DIRECT)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        dest = super().resolve_tensor(read_item)
        return self.buffer[: dest.numel()].view(dest.shape)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        super().resolve_tensor(read_item).copy_(tensor)


@pytest.mark.parametrize("verify", [True, False])
def test_a_planner_that_stages_targets_gets_each_read_resolved_copied_and_committed(
    s3_bucket: StoreTarget, verify: bool
) -> None:
    """Its targets are not the state dict and are reused between reads: nothing is
    fetched into them ahead of the read they serve (a small read resolved later
    would overwrite a large one's bytes before its check, or, unchecked, its data)."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(100.0), "b": torch.randn(4 * DIRECT)}
    url = s3_bucket.url("staging")
    save(state, url, s3_bucket)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = ObjectStoreReader(
        url, storage_options=s3_bucket.storage_options, read=ReadOptions(verify=verify)
    )
    dcp.load(got, storage_reader=reader, planner=_Staging())
    assert_state_equal(got, state)


def test_names_sharing_memory_load_without_a_false_checksum_error(s3_bucket: StoreTarget) -> None:
    """A state dict whose small tensor is a view into a large one (tied or packed
    parameters), loading a checkpoint where they differ: each read lands in turn (the
    last wins, as with DCP's readers), and the large one is never checked over bytes
    the small one's copy wrote."""
    state = {"a": torch.arange(100.0), "b": torch.randn(4 * DIRECT)}
    url = s3_bucket.url("tied")
    save(state, url, s3_bucket)
    shared = torch.zeros(4 * DIRECT)
    load({"a": shared[:100], "b": shared}, url, s3_bucket)
    assert torch.equal(shared[100:], state["b"][100:])
    assert torch.equal(shared[:100], state["a"]) or torch.equal(shared[:100], state["b"][:100])


class _Marked(torch.Tensor):
    """A plain subclass: its own storage (``as_subclass``), kept through ``detach``."""


def test_a_subclass_view_of_a_placed_tensor_counts_as_sharing_its_memory(
    s3_bucket: StoreTarget,
) -> None:
    """A subclass viewing a large target's memory (``as_subclass``) is copied into
    after the fetch: the large target is not placed, so it is never checked over
    bytes the subclass's copy wrote (a false checksum error when the two differ)."""
    state = {"a": torch.randn(4 * DIRECT), "b": torch.randn(4 * DIRECT)}
    url = s3_bucket.url("subclass-view")
    save(state, url, s3_bucket)
    shared = torch.zeros(4 * DIRECT)
    load({"a": shared.as_subclass(_Marked), "b": shared}, url, s3_bucket)
    assert torch.equal(shared, state["a"]) or torch.equal(shared, state["b"])


def test_a_placed_tensor_counts_as_changed(s3_bucket: StoreTarget) -> None:
    """Bytes written straight into a target move its version counter, as ``copy_``
    does: what watches the counter (a save's deferred copy, autograd) sees the load."""
    state = {"w": torch.randn(4 * DIRECT)}
    url = s3_bucket.url("versions")
    save(state, url, s3_bucket)
    got = {"w": torch.zeros(4 * DIRECT)}
    before = got["w"]._version
    load(got, url, s3_bucket)
    assert got["w"]._version > before
    assert torch.equal(got["w"], state["w"])
