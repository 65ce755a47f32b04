"""Rank bodies of the peer wire's tests (module-level, so spawn can import them).

Two gloo ranks exchange files over :class:`objckpt.ops.peers.PeerGroup` at once, as
one replication round does: each sends its own directory's files to the other and
receives the other's. A rank's ``fault`` breaks its own side only (a file that
cannot be read, a receiving disk that is full), and every rank records what its
exchange returned, so the test asserts what each side saw.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any
from unittest import mock

import torch.distributed as dist
from ranks import init_ranks

from objckpt.ops.peers import CHUNK, FileSpec, PeerGroup
from objckpt.writers.checksum import Crc32c


def _spec(path: str, key: str) -> FileSpec:
    with open(path, "rb") as f:
        data = f.read()
    crc = Crc32c()
    crc.update(data)
    return FileSpec(key, path, len(data), crc.hexdigest())


def swap_files(rank: int, world: int, init_file: str, base: str, fault: dict[str, str]) -> None:
    """Rank r sends ``<base>/own<r>/*`` to the other rank and receives into
    ``<base>/into<r>``; what ``exchange`` returned goes to ``<base>/result<r>.json``."""
    init_ranks(rank, world, init_file)
    try:
        group = PeerGroup.create(None, timeout=60)
        own = os.path.join(base, f"own{rank}")
        files = [_spec(os.path.join(own, k), k) for k in sorted(os.listdir(own))]
        into = os.path.join(base, f"into{rank}")
        other = 1 - rank
        real_open = open
        what = fault.get(str(rank))

        def faulty_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            p = os.fspath(path)
            if what == "read" and p.startswith(own) and "r" in mode and p.endswith(".distcp"):
                raise OSError(errno.EIO, os.strerror(errno.EIO), p)
            if what == "full" and p.startswith(into) and ("w" in mode or "x" in mode):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
            return real_open(path, mode, *args, **kwargs)

        with mock.patch("builtins.open", faulty_open):
            sent, kept, received = group.exchange((other, files), (other, into))
        with open(os.path.join(base, f"result{rank}.json"), "w") as f:
            json.dump({"sent": sent, "kept": kept, "received": received}, f)
    finally:
        dist.destroy_process_group()


def payload(size: int, seed: int) -> bytes:
    """``size`` bytes that differ per seed and position (a shifted chunk shows)."""
    block = bytes((seed * 31 + i) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


#: A payload spanning more than two wire chunks, with a tail.
LARGE = 2 * CHUNK + 12345
