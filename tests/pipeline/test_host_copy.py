"""The staging copy on several threads: every byte lands, shares are even, errors surface."""

from __future__ import annotations

import threading

import pytest
import torch

from objckpt.pipeline import host_copy
from objckpt.pipeline.host_copy import HostCopier

MiB = 2**20


def _state() -> list[torch.Tensor]:
    """Tensors of every kind the copy must handle: sizes below and above a piece (with a
    ragged tail), several dtypes, empty and 0-dim ones, and a non-contiguous source."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(9 * MiB // 4 + 3, generator=g),  # > two pieces, ragged
        torch.randn(1000, 1000, generator=g).to(torch.bfloat16),
        torch.randint(0, 2**40, (3 * MiB // 8 + 1,), generator=g),  # int64
        torch.rand(5000, generator=g) > 0.5,  # bool
        torch.empty(0),
        torch.tensor(7.5),  # 0-dim
        torch.randn(3000, 1000, generator=g).t(),  # non-contiguous: copied whole
        torch.randn(17, generator=g),
    ]


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the copier use four threads on any CI machine (it caps at the usable CPUs)."""
    monkeypatch.setattr(host_copy, "usable_cpus", lambda: 4)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_byte_lands_in_its_view(four_cpus: None, threads: int) -> None:
    sources = _state()
    views = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    copier = HostCopier(threads)
    try:
        copier.copy(sources, views, cuda=False)
    finally:
        copier.close()
    assert copier.threads == threads
    for src, view in zip(sources, views, strict=True):
        assert view.dtype == src.dtype and torch.equal(view, src)


def test_a_large_copy_runs_on_several_threads_in_even_shares(
    four_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, int]] = []
    lock = threading.Lock()
    real = host_copy._copy_share
    # Every share waits for the other two: the copy passes only when three shares run
    # at once, whatever thread the pool would have reused on a loaded machine.
    together = threading.Barrier(3, timeout=60)

    def spy(share: list[host_copy._Piece]) -> None:
        with lock:
            ran.append((threading.current_thread().name, sum(p[2] for p in share)))
        together.wait()
        real(share)

    monkeypatch.setattr(host_copy, "_copy_share", spy)
    sources = [torch.randn(MiB // 4) for _ in range(24)] + [torch.randn(10 * MiB // 4)]
    views = [torch.empty_like(s) for s in sources]
    copier = HostCopier(3)
    try:
        copier.copy(sources, views, cuda=False)
    finally:
        copier.close()
    assert len({name for name, _ in ran}) == 3  # the caller and two pool threads
    assert threading.current_thread().name in {name for name, _ in ran}
    sizes = [n for _, n in ran]
    assert sum(sizes) == 34 * MiB
    assert max(sizes) - min(sizes) <= host_copy._PIECE  # even to within one piece
    assert all(torch.equal(v, s) for v, s in zip(views, sources, strict=True))


def test_shares_keep_staging_order_and_split_by_bytes() -> None:
    pieces = [(torch.empty(0), torch.empty(0), n, False, 0, 0) for n in (5, 1, 1, 1, 8, 2, 2, 4)]
    shares = host_copy._shares(pieces, 3)
    assert [p for share in shares for p in share] == pieces
    assert [sum(p[2] for p in s) for s in shares] == [8, 8, 8]
    assert host_copy._shares(pieces[:1], 4) == [pieces[:1]]  # never an empty share


class _Marked(torch.Tensor):
    """A tensor subclass: its layout is torch's business, never copied as raw bytes."""


def _layouts() -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
    """(what, source, view, copied as raw bytes) for each kind of pair the copy meets."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, dtype=torch.complex64, generator=g)
    x = torch.randn(400, 300, generator=g)
    return [
        ("contiguous fp32", x, torch.empty(400, 300), True),
        ("flat view of a 2-d source", x, torch.empty(120_000), True),
        ("bf16", x.to(torch.bfloat16), torch.empty(400, 300, dtype=torch.bfloat16), True),
        ("empty", torch.empty(0), torch.empty(0), True),
        ("0-dim", torch.tensor(2.5), torch.empty(()), True),
        ("conjugated view", z.conj(), torch.empty(300, dtype=torch.complex64), False),
        ("negated view", torch._neg_view(x), torch.empty(400, 300), False),
        ("transposed", x.t(), torch.empty(300, 400), False),
        ("subclass", x.as_subclass(_Marked), torch.empty(400, 300), False),
        ("parameter", torch.nn.Parameter(x.clone()), torch.empty(400, 300), True),
        ("another dtype", x, torch.empty(400, 300, dtype=torch.float64), False),
        ("storage offset", x[7:19], torch.empty(12, 300), True),
        ("size-1 dim, odd stride", x[:, 5:6].t(), torch.empty(1, 400), False),
        ("row of size-1 dims", x[3:4, :].t().t(), torch.empty(1, 300), True),
        ("zero tensor (no memory)", torch._efficientzerotensor(300), torch.empty(300), False),
    ]


@pytest.mark.parametrize("case", range(len(_layouts())), ids=[c[0] for c in _layouts()])
def test_raw_byte_copies_only_where_the_bytes_are_the_values(
    case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memmove for a plain dense pair; ``copy_`` for any layout whose bytes are not
    the values (a conjugated or negated view holds the unconjugated bytes)."""
    what, src, view, raw = _layouts()[case]
    moved: list[int] = []

    def counting(dst: int, source: int, count: int) -> int:
        moved.append(count)
        return host_copy.ctypes.memmove(dst, source, count)

    monkeypatch.setattr(host_copy, "_memmove", counting)
    assert host_copy._raw(src.detach(), view) is raw, what
    HostCopier(1).copy([src], [view], cuda=False)
    expected = src.detach().resolve_conj().resolve_neg().as_subclass(torch.Tensor).to(view.dtype)
    assert torch.equal(view.reshape(expected.shape), expected)
    assert sum(moved) == (src.numel() * src.element_size() if raw else 0)
    again = torch.zeros_like(view)  # the staging waves' one-tensor copy decides alike
    host_copy.copy_tensor(src, again)
    assert torch.equal(again.reshape(expected.shape), expected)
    assert sum(moved) == (2 * src.numel() * src.element_size() if raw else 0)


def test_a_small_copy_stays_on_the_calling_thread(four_cpus: None) -> None:
    copier = HostCopier(4)
    sources = [torch.randn(1000) for _ in range(10)]
    views = [torch.empty_like(s) for s in sources]
    copier.copy(sources, views, cuda=False)
    assert copier._pool is None  # no thread was started for 40 KB
    assert all(torch.equal(v, s) for v, s in zip(views, sources, strict=True))


def _failing_two_thread_copy(error: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy 8 MiB on two threads, expecting ``OSError(error)``; the sources and views."""
    sources = [torch.randn(2 * MiB) for _ in range(4)]
    views = [torch.zeros_like(s) for s in sources]
    copier = HostCopier(2)
    try:
        with pytest.raises(OSError, match=error):
            copier.copy(sources, views, cuda=False)
    finally:
        copier.close()
    return sources, views


def test_an_error_is_raised_only_after_every_share_ended(
    four_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller must not reuse the views (or report) while a share still writes."""
    failing = threading.Event()
    ended = threading.Event()
    real = host_copy._copy_share

    def caller_fails_first(share: list[host_copy._Piece]) -> None:
        if threading.current_thread() is threading.main_thread():
            failing.set()
            raise OSError("disk on fire")
        assert failing.wait(30)  # the other share starts only once the caller failed
        real(share)
        ended.set()

    monkeypatch.setattr(host_copy, "_copy_share", caller_fails_first)
    sources, views = _failing_two_thread_copy("disk on fire")
    assert ended.is_set()
    assert torch.equal(views[-1], sources[-1])  # the other share's bytes are all there


def test_an_error_in_another_threads_share_reaches_the_caller(
    four_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = host_copy._copy_share

    def pool_fails(share: list[host_copy._Piece]) -> None:
        if threading.current_thread() is threading.main_thread():
            real(share)
        else:
            raise OSError("bad page")

    monkeypatch.setattr(host_copy, "_copy_share", pool_fails)
    _failing_two_thread_copy("bad page")


def test_close_stops_the_threads_and_a_later_copy_starts_new_ones(four_cpus: None) -> None:
    copier = HostCopier(2)
    sources = [torch.randn(2 * MiB) for _ in range(4)]
    views = [torch.empty_like(s) for s in sources]
    copier.copy(sources, views, cuda=False)
    pool = copier._pool
    assert pool is not None
    copier.close()
    assert copier._pool is None and pool._shutdown
    copier.copy(sources, views, cuda=False)
    assert copier._pool is not None and copier._pool is not pool
    copier.close()


def test_threads_are_capped_at_the_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "usable_cpus", lambda: 2)
    assert HostCopier(8).threads == 2
    assert HostCopier(1).threads == 1
