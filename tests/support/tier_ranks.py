"""Rank bodies of the local tier's restart tests (module-level so spawn can import them).

Each rank's tier directory is ``<local>/node<n>``, as on its own node; ``swap`` puts
rank r on node ``world - 1 - r``, as an elastic restart that moves rank 0 to another
node does (c10d rendezvous keeps no node ranks).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from dist_helpers import blank_tiered_state, full_state, tiered_state
from ranks import init_ranks

import objckpt


def _node(options: dict[str, Any], rank: int, world: int) -> str:
    node = world - 1 - rank if options.get("swap") else rank
    return os.path.join(options["local"], f"node{node}")


def _manager(rank: int, world: int, url: str, options: dict[str, Any]) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        url,
        storage_options=options["storage"],
        async_options=objckpt.AsyncOptions(workers=1, barrier_timeout=120),
        local=objckpt.LocalTier(
            _node(options, rank, world),
            retention=objckpt.RetentionPolicy(keep_last=3),
            promote_every=2,
        ),
    )


def save_three(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    """Steps 1 and 3 committed on the local tier only, step 2 promoted (durable)."""
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(rank, world, url, options) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, tiered_state(mesh, step))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [2] and mgr.local_steps() == [1, 2, 3], rank
    finally:
        dist.destroy_process_group()


def restart_and_load(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Restart (on the nodes ``options`` says) and load the newest step every rank can
    load; it must be ``options["expect"]``, bit-exact."""
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(rank, world, url, options) as mgr:
            got = blank_tiered_state(mesh)
            step = mgr.load(got)
            assert step == options["expect"], (rank, step)
            for k, v in full_state().items():
                assert torch.equal(got["model"][k].full_tensor(), v + step), (rank, k)
            assert got["step"] == step
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _listing_fails(path: str) -> Iterator[None]:
    """Listing ``path`` itself fails (EACCES) in this process, as a transient error or
    a directory this rank may not read would; everything else lists as usual."""
    scandir, listdir = os.scandir, os.listdir

    def refuse(real: Any) -> Any:
        def call(p: Any = ".") -> Any:
            if os.path.abspath(os.fspath(p)) == os.path.abspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(p))
            return real(p)

        return call

    with (
        mock.patch.object(os, "scandir", refuse(scandir)),
        mock.patch.object(os, "listdir", refuse(listdir)),
    ):
        yield


def restart_with_rank1_unable_to_list(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Rank 1 cannot list its tier directory at start: the manager still starts on
    every rank (nothing is swept anywhere), and the ranks load together after it:
    step 3, local only, from each node's own disk."""
    mesh = init_ranks(rank, world, init_file)
    try:
        fails = _listing_fails(_node(options, rank, world)) if rank == 1 else None
        with fails or contextlib.nullcontext():
            mgr = _manager(rank, world, url, options)
        with mgr:
            got = blank_tiered_state(mesh)
            assert mgr.load(got) == 3, rank
            for k, v in full_state().items():
                assert torch.equal(got["model"][k].full_tensor(), v + 3), (rank, k)
    finally:
        dist.destroy_process_group()
