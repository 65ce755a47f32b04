"""A staging directory with little room, without a filesystem of that size.

Mounting a small tmpfs needs root; most test machines do not give it. What staging
sees of a directory's room is two calls, ``os.statvfs`` (its free bytes) and
``os.posix_fallocate`` (the reservation), and :func:`simulated_room` answers both
for one directory as a filesystem of ``capacity`` bytes would: the bytes this
process's segments hold there are used, the rest is free, and a reservation past
it fails with ``ENOSPC`` (as tmpfs does, after returning the pages it took).

Module-level (with a rank body) so a spawned rank can import it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from typing import Any

from objckpt.pipeline.lifeline import segment_prefix


@contextlib.contextmanager
def simulated_room(directory: str, capacity: int, *, can_reserve: bool = True) -> Iterator[None]:
    """Make ``directory`` a filesystem of ``capacity`` bytes to this process's staging.

    Args:
        directory: The staging directory (other paths see the real calls).
        capacity: Bytes the simulated filesystem holds.
        can_reserve: False: ``posix_fallocate`` fails with ``EOPNOTSUPP`` there, as
            on a filesystem that cannot reserve bytes.
    """
    real_statvfs, real_fallocate = os.statvfs, os.posix_fallocate
    where = os.path.realpath(directory)
    prefix = segment_prefix()

    def used() -> int:
        return sum(e.stat().st_size for e in os.scandir(where) if e.name.startswith(prefix))

    def statvfs(path: Any) -> os.statvfs_result:
        st = real_statvfs(path)
        if os.path.realpath(path) != where:
            return st
        free = max(0, capacity - used())
        inodes = (st.f_files, st.f_ffree, st.f_favail)
        return os.statvfs_result(
            (st.f_bsize, 1, capacity, free, free, *inodes, st.f_flag, st.f_namemax)
        )

    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        path = os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
        if os.path.dirname(path) != where:
            return real_fallocate(fd, offset, length)
        if not can_reserve:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        if offset + length - os.fstat(fd).st_size > capacity - used():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fallocate(fd, offset, length)

    os.statvfs, os.posix_fallocate = statvfs, posix_fallocate
    try:
        yield
    finally:
        os.statvfs, os.posix_fallocate = real_statvfs, real_fallocate


def no_room_on_rank1(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    """Rank 1's staging directory holds 64 KiB, less than its largest tensor: its save
    fails on both ranks; then its directory has room and the next save commits on both."""
    import torch
    import torch.distributed as dist
    from ranks import init_ranks

    import objckpt

    init_ranks(rank, world, init_file)
    staging = os.path.join(out, f"staging-rank{rank}")
    os.mkdir(staging)
    state = {f"r{rank}.w": torch.arange(64 * 1024, dtype=torch.float32) + rank}

    def record(name: str, save: Any) -> None:
        try:
            save()
            report: dict[str, Any] = {"outcome": "ok"}
        except BaseException as exc:  # CheckpointException is a BaseException
            report = {"outcome": "error", "type": type(exc).__name__, "error": str(exc)}
        report["segments"] = sorted(os.listdir(staging))
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(report, f)

    try:
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=30, staging_dir=staging)
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:

            def no_room() -> None:
                room = simulated_room(staging, 64 * 1024 if rank == 1 else 1 << 30)
                with room:
                    handle = ckpt.save(state, f"{root}/full")
                handle.result(timeout=120)

            record("full", no_room)
            record("next", lambda: ckpt.save(state, f"{root}/next").result(timeout=120))
    finally:
        dist.destroy_process_group()
