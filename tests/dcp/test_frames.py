"""Tensor frames: the torch.save container built once per dtype and shape, with the
tensor's raw bytes written between head and tail; stock torch and DCP read it."""

from __future__ import annotations

import gc
import io
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import quiet
from torch.distributed.checkpoint import FileSystemReader

from objckpt import AsyncCheckpointer, ObjectStoreWriter
from objckpt._torch import tensor_frame
from objckpt.dcp.serialize import Framer, serialized_tensor, tensor_bytes, unframe

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0,), (3, 5), (2, 0, 4), (1000,)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape) * 31 + DTYPES.index(dtype))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_frame_plus_raw_bytes_is_a_file_torch_load_reads(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = _sample(dtype, shape)
    frame = tensor_frame(dtype, shape)
    assert frame is not None
    head, tail = frame
    loaded = torch.load(io.BytesIO(head + bytes(tensor_bytes(t)) + tail), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == t.shape
    assert torch.equal(loaded, t)


def test_framer_builds_each_frame_once_and_declines_what_it_cannot_frame() -> None:
    framer = Framer()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    first = framer.frame(a)
    assert first is not None and framer.frame(b) is first  # one frame per dtype+shape
    assert framer.frame(torch.randn(4, 4, dtype=torch.float64)) is not first
    assert framer.frame(torch.randn(3, dtype=torch.complex64).conj()) is None
    assert framer.frame(torch.nn.Parameter(torch.randn(2))) is None  # a subclass
    assert framer.frame(torch.randn(3, 3).to_sparse()) is None


def test_framer_is_bounded() -> None:
    framer = Framer(max_frames=2)
    frames = [framer.frame(torch.zeros(n)) for n in (1, 2, 3)]
    assert all(f is not None for f in frames)
    assert framer.frame(torch.zeros(1)) is not frames[0]  # the oldest was dropped


def _odd_state() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "conj": torch.randn(5, dtype=torch.complex64).conj(),  # torch.save path
        "param": torch.nn.Parameter(torch.randn(3, 2)),
        "view": base[:, 1:4],  # non-contiguous: cloned first
        "row": base[2],  # a view of a larger storage
        "bf16": torch.randn(7).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
    }


def _check_stock_load(path: Path, state: dict[str, torch.Tensor]) -> None:
    got = {k: torch.zeros_like(v.detach()).resolve_conj() for k, v in state.items()}
    with quiet():
        dcp.load(got, storage_reader=FileSystemReader(str(path)))
    for k, v in state.items():
        assert torch.equal(got[k], v.detach().resolve_conj()), k


def test_sync_save_of_odd_tensors_loads_with_the_stock_reader(tmp_path: Path) -> None:
    state = _odd_state()
    with quiet():
        dcp.save(state, storage_writer=ObjectStoreWriter(f"file://{tmp_path}/c"))
    _check_stock_load(tmp_path / "c", state)


def test_async_save_of_odd_tensors_loads_with_the_stock_reader(tmp_path: Path) -> None:
    state = _odd_state()
    del state["conj"]  # async staging copies values; conj views resolve there
    with AsyncCheckpointer() as ckpt:
        ckpt.save(state, f"file://{tmp_path}/c").result(timeout=120)
    _check_stock_load(tmp_path / "c", state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unframe_reads_a_framed_tensor_without_torch_load(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = _sample(dtype, shape)
    frame = tensor_frame(dtype, shape)
    data = memoryview(serialized_tensor(t, Framer()))
    got = unframe(data, frame, dtype, shape)
    assert got is not None and got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, t)


def test_unframe_declines_anything_but_an_exact_frame() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    frame = tensor_frame(t.dtype, (3, 4))
    assert frame is not None
    good = serialized_tensor(t, Framer())
    head, tail = len(frame[0]), len(frame[1])
    flipped_head = bytearray(good)
    flipped_head[head // 2] ^= 1
    flipped_tail = bytearray(good)
    flipped_tail[-tail // 2] ^= 1
    for bad in (bytes(flipped_head), bytes(flipped_tail), good[:-1], good + b"\0"):
        assert unframe(memoryview(bad), frame, t.dtype, (3, 4)) is None
    # the right bytes read as another dtype or shape: declined, not reinterpreted
    assert unframe(memoryview(good), tensor_frame(torch.int32, (3, 4)), torch.int32, (3, 4)) is None
    assert unframe(memoryview(good), tensor_frame(t.dtype, (4, 3)), t.dtype, (4, 3)) is None
    assert unframe(memoryview(good), None, t.dtype, (3, 4)) is None


def test_objckpt_reader_loads_framed_tensors_without_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every framed tensor of an objckpt checkpoint is read by comparing frames; only
    what torch.save wrote itself (a conjugate view) goes to torch.load."""
    from objckpt import ObjectStoreReader

    state = _odd_state()
    with quiet():
        dcp.save(state, storage_writer=ObjectStoreWriter(f"file://{tmp_path}/c"))
    loads: list[int] = []
    real_load = torch.load

    def counting(*args: object, **kwargs: object) -> object:
        loads.append(1)
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", counting)
    got = {k: torch.zeros_like(v.detach()).resolve_conj() for k, v in state.items()}
    with quiet():
        dcp.load(got, storage_reader=ObjectStoreReader(f"file://{tmp_path}/c"))
    for k, v in state.items():
        assert torch.equal(got[k], v.detach().resolve_conj()), k
    assert len(loads) == 1  # the conjugate view, which torch.save wrote


def test_tensor_bytes_keeps_its_tensor_alive() -> None:
    """An upload may still send from the view after the writer let go of the tensor
    (e.g. the contiguous copy of a view it made for the save)."""
    t = torch.arange(1000, dtype=torch.float32)
    ref = weakref.ref(t)
    view = tensor_bytes(t)
    del t
    gc.collect()
    assert ref() is not None
    assert bytes(view) == torch.arange(1000, dtype=torch.float32).numpy().tobytes()
    del view
    gc.collect()
    assert ref() is None
