"""Rank bodies of the peer wire's tests (module-level, so spawn can import them).

Two gloo ranks exchange files over :class:`objckpt.ops.tier.peers.PeerGroup` at once, as
one replication round does: each sends its own directory's files to the other and
receives the other's. A rank's ``fault`` breaks its own side only (a file that
cannot be read, a receiving disk that is full), and every rank records what its
exchange returned, so the test asserts what each side saw.
"""

from __future__ import annotations

import errno
import json
import os
import tracemalloc
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from ranks import init_ranks

from objckpt.ops.tier import peers
from objckpt.ops.tier.peers import CHUNK, FileSpec, PeerGroup
from objckpt.writers.checksum import Crc32c
from objckpt.writers.node_store import NodeStore


def _spec(path: str, key: str) -> FileSpec:
    with open(path, "rb") as f:
        data = f.read()
    crc = Crc32c()
    crc.update(data)
    return FileSpec(key, NodeStore(os.path.dirname(path)), key, len(data), crc.hexdigest())


class _Crafted(Exception):
    """Raised on a crafting rank to skip the rest of its exchange."""


def _craft(group: PeerGroup, what: str, rank: int, base: str) -> list[FileSpec] | None:
    """Make this rank's exchange send what objckpt never sends: ``length:<n>`` (the
    header's length int says n, then this rank stops), ``size:<n>`` (its header lists
    a file of n bytes, then it stops before the bytes). Returns the files to announce
    for ``size``; the crafting rank's exchange ends in :class:`_Crafted`."""
    kind, _, value = what.partition(":")
    number = int(value)
    if kind == "length":
        real_int = group._int

        def crafted_int(v: int, dst: int | None, src: int | None) -> int:
            real_int(number, dst, src)
            raise _Crafted

        group._int = crafted_int  # type: ignore[method-assign]
        return None

    def no_stream(*a: Any, **k: Any) -> bool:
        raise _Crafted

    group._stream = no_stream  # type: ignore[method-assign]
    key = f"__{rank}_0.0123456789abcdef.distcp"
    return [FileSpec(key, NodeStore(base), key, number, "00000000")]


def swap_files(
    rank: int,
    world: int,
    init_file: str,
    base: str,
    fault: dict[str, str],
    into_of: dict[str, str] | None = None,
    timeout: float = 60,
) -> None:
    """Rank r sends ``<base>/own<r>/*`` to the other rank and receives into
    ``<base>/into<r>`` (or ``into_of[r]``); what ``exchange`` returned (or raised)
    goes to ``<base>/result<r>.json``, with the tracemalloc peak of the exchange and
    the sizes torch allocated during it.

    A rank's ``fault``: ``read`` (its payloads cannot be read), ``full`` (its disk
    refuses writes), ``read-late`` (a payload's second chunk cannot be read), ``die``
    (it exits after its second received chunk: the peer has written a chunk of its
    file by then), ``length:<n>`` / ``size:<n>`` (a crafted header, see
    :func:`_craft`). Ranks meet at a barrier after the exchange (but a dead one)."""
    init_ranks(rank, world, init_file)
    try:
        group = PeerGroup.create(None, timeout=timeout)
        own = os.path.join(base, f"own{rank}")
        files = [_spec(os.path.join(own, k), k) for k in sorted(os.listdir(own))]
        into = (into_of or {}).get(str(rank)) or os.path.join(base, f"into{rank}")
        other = 1 - rank
        real_read = NodeStore.open_read
        what = fault.get(str(rank), "")
        dying = "die" in fault.values()
        crafted = _craft(group, what, rank, base) if ":" in what else None
        if crafted is not None:
            files = crafted
        if what == "die":
            calls = []

            def die_on_second(*a: Any, **k: Any) -> None:
                calls.append(1)
                if len(calls) == 2:
                    os._exit(0)  # a clean exit: spawn waits for the other rank

            peers._Incoming.write = die_on_second  # type: ignore[method-assign]

        # A sender reads its files through the node store (never through a link).
        def faulty_read(store: NodeStore, rel: str) -> Any:
            p = os.path.join(store.root, rel)
            if what == "read" and p.startswith(own) and p.endswith(".distcp"):
                raise OSError(errno.EIO, os.strerror(errno.EIO), p)
            f = real_read(store, rel)
            if what == "read-late" and p.startswith(own) and p.endswith(".distcp"):
                return _LateFail(f)
            return f

        real_os_open = os.open

        def faulty_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
            if what == "full" and flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
            return real_os_open(path, flags, *args, **kwargs)

        allocated: list[int] = []
        real_empty, real_zeros = torch.empty, torch.zeros

        def spy(real: Any) -> Any:
            def alloc(*size: Any, **kwargs: Any) -> Any:
                n = 1
                for d in size[0] if size and isinstance(size[0], (tuple, list)) else size:
                    n *= int(d)
                allocated.append(n)
                if n > 256 << 20:  # never let a crafted header allocate it here
                    raise RuntimeError(f"the wire asked torch for {n} bytes")
                return real(*size, **kwargs)

            return alloc

        result: dict[str, Any] = {}
        tracemalloc.start()
        try:
            with (
                mock.patch.object(NodeStore, "open_read", faulty_read),
                mock.patch("os.open", faulty_os_open),
                mock.patch("torch.empty", spy(real_empty)),
                mock.patch("torch.zeros", spy(real_zeros)),
            ):
                sent, kept, received = group.exchange((other, files), (other, into))
            result = {"sent": sent, "kept": kept, "received": received}
        except _Crafted:
            result = {"crafted": True}
        except Exception as exc:  # what the test asserts: raised, and why
            result = {"raised": f"{type(exc).__name__}: {exc}"}
        result["peak"] = tracemalloc.get_traced_memory()[1]
        result["allocated"] = allocated
        tracemalloc.stop()
        with open(os.path.join(base, f"result{rank}.json"), "w") as f:
            json.dump(result, f)
        if not dying:
            dist.barrier()
    finally:
        dist.destroy_process_group()


class _LateFail:
    """A file whose reads fail after the first chunk (a disk error mid-file)."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _LateFail:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def readinto(self, buf: Any) -> int:
        if self._f.tell() >= CHUNK:
            raise OSError(errno.EIO, os.strerror(errno.EIO), self._f.name)
        return int(self._f.readinto(buf))


def payload(size: int, seed: int) -> bytes:
    """``size`` bytes that differ per seed and position (a shifted chunk shows)."""
    block = bytes((seed * 31 + i) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


#: A payload spanning more than two wire chunks, with a tail.
LARGE = 2 * CHUNK + 12345
