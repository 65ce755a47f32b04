"""Rank bodies of the lost-node tests: a local tier with replicas across nodes.

Each rank sets torchrun's environment for itself before its manager starts: the job
runs ``per_node`` ranks on each node (``GROUP_RANK = rank // per_node``), and each
node's tier is ``<local>/node<GROUP_RANK>``, as its own disk. A test deletes a
node's directory between two jobs: that node is lost, and the next job runs on a
replacement (an empty directory at the same place) or on fewer nodes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from dist_helpers import blank_tiered_state, full_state, tiered_state
from ranks import init_ranks

import objckpt
import objckpt.errors


def _join(rank: int, world: int, init_file: str, per_node: int) -> Any:
    os.environ.update(
        GROUP_RANK=str(rank // per_node),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
    )
    return init_ranks(rank, world, init_file)


def _tier_dir(rank: int, o: dict[str, Any]) -> str:
    """``<local>/node<GROUP_RANK>``, shared by the node's ranks; with
    ``o["own_dirs"]`` each rank of the node has its own, ``.../r<LOCAL_RANK>``."""
    node = os.path.join(o["local"], f"node{rank // o['per_node']}")
    return os.path.join(node, f"r{rank % o['per_node']}") if o.get("own_dirs") else node


def _manager(rank: int, url: str, o: dict[str, Any]) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        url,
        storage_options=o["storage"],
        async_options=objckpt.AsyncOptions(workers=1, barrier_timeout=o.get("timeout", 60)),
        local=objckpt.LocalTier(
            _tier_dir(rank, o),
            retention=objckpt.RetentionPolicy(keep_last=o.get("keep_last", 3)),
            promote_every=100,  # only what the test promotes
            replicas=o.get("replicas", 2),
            replication_timeout=o.get("timeout", 60),
        ),
    )


@contextlib.contextmanager
def _full_under(part: str) -> Iterator[None]:
    """Writes to files whose path contains ``part`` fail with ENOSPC in this process
    (a disk that filled up), everything else as usual: through ``open`` and through
    the node store's files (how received replicas are written)."""
    from objckpt.writers.node_store import PendingFile

    real = open
    real_write = PendingFile.write

    def full(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if part in os.fspath(path) and any(c in mode for c in "wxa"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real(path, mode, *args, **kwargs)

    def full_write(self: PendingFile, data: Any) -> None:
        if part in self.path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        real_write(self, data)

    with mock.patch("builtins.open", full), mock.patch.object(PendingFile, "write", full_write):
        yield


def save_durable_then_local(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Step 1 promoted (durable), step 2 on the local tier only; both replicated."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            one = mgr.save(1, tiered_state(mesh, 1), promote=True)
            two = mgr.save(2, tiered_state(mesh, 2), promote=False)
            mgr.wait_until_finished()
            assert one.wait_durable() and not two.will_be_durable, rank
            assert one.wait_replicated() and two.wait_replicated(), rank
            assert two.seconds_to_replicated is not None, rank
            status = mgr.tier_status()
            assert status.replicas == 2 and status.replicated_latest == 2, (rank, status)
            assert status.not_replicated == () and status.replication_error is None, status
            assert mgr.all_steps() == [1] and mgr.local_steps() == [1, 2], rank
    finally:
        dist.destroy_process_group()


def restart_and_load(rank: int, world: int, init_file: str, url: str, o: dict[str, Any]) -> None:
    """Restart on ``world`` ranks and load the newest step: ``o["expect"]``, bit-exact
    (its values ``full_state() + o["value"]``, the step by default); rank 0 writes
    the warnings it logged to ``<local>/warnings.txt``."""
    mesh = _join(rank, world, init_file, o["per_node"])
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("objckpt").addHandler(handler)
    try:
        with _manager(rank, url, o) as mgr:
            got = blank_tiered_state(mesh)
            step = mgr.load(got)
            assert step == o["expect"], (rank, step)
            value = o.get("value", step)
            for k, v in full_state().items():
                assert torch.equal(got["model"][k].full_tensor(), v + value), (rank, k)
            assert got["step"] == step
            mgr.wait_until_finished()  # a replaced node's replicas are sent again
        if rank == 0:
            with open(os.path.join(o["local"], "warnings.txt"), "w") as f:
                f.write("\n".join(seen))
    finally:
        logging.getLogger("objckpt").removeHandler(handler)
        dist.destroy_process_group()


def save_with_a_full_peer_disk(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Node 1's disk is full for replicas while step 2 replicates: step 2 stays
    committed on the local tier, every rank reports it not replicated, and step 3
    (the disk has room again) saves and replicates."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            assert mgr.save(1, tiered_state(mesh, 1)).wait_replicated(), rank
            full = _full_under("/replicas/") if rank // o["per_node"] == 1 else None
            with full or contextlib.nullcontext():
                two = mgr.save(2, tiered_state(mesh, 2))
                two.result()  # committed: a replication failure never fails the save
                assert two.wait_replicated() is False, rank
            status = mgr.tier_status()
            assert status.not_replicated == (2,), (rank, status)
            assert status.replicated_latest == 1, (rank, status)
            assert "No space left" in (status.replication_error or ""), (rank, status)
            assert 2 in mgr.local_steps(), rank
            three = mgr.save(3, tiered_state(mesh, 3))
            assert three.wait_replicated(), rank
            assert mgr.tier_status().replicated_latest == 3, rank
    finally:
        dist.destroy_process_group()


def save_three_keep_one(rank: int, world: int, init_file: str, url: str, o: dict[str, Any]) -> None:
    """Steps 1, 2, 3 on the local tier with ``keep_last=1``: each retired step's
    replicas go with it."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, tiered_state(mesh, step))
            mgr.wait_until_finished()
            assert mgr.local_steps() == [3], rank
    finally:
        dist.destroy_process_group()


def discard_local_step(rank: int, world: int, init_file: str, url: str, o: dict[str, Any]) -> None:
    """``discard_after(1)`` after step 2 was saved locally and replicated: step 2 is
    gone from every node, replicas included, and a restart resumes from step 1."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            assert mgr.discard_after(1) == [2], rank
            got = blank_tiered_state(mesh)
            assert mgr.load(got) == 1, rank
            assert torch.equal(got["model"]["w"].full_tensor(), full_state()["w"] + 1), rank
    finally:
        dist.destroy_process_group()


def peer_dies_mid_transfer(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Rank 3 dies while it receives rank 1's files of step 1 (its process exits
    from the replication thread). The others' save already returned; their
    replication ends within the peers' timeout, reported not replicated, and
    ``wait_until_finished`` returns. Each survivor writes ``<local>/outcome<r>.json``."""
    import json
    import time

    from objckpt.ops.tier import peers

    mesh = _join(rank, world, init_file, o["per_node"])
    if rank == 3:
        peers._Incoming.write = lambda *a, **k: os._exit(17)  # type: ignore[method-assign]
    mgr = _manager(rank, url, o)
    handle = mgr.save(1, tiered_state(mesh, 1))
    handle.result()
    started = time.monotonic()
    replicated = handle.wait_replicated()
    mgr.wait_until_finished()
    waited = time.monotonic() - started
    status = mgr.tier_status()
    with open(os.path.join(o["local"], f"outcome{rank}.json"), "w") as f:
        json.dump(
            {
                "replicated": replicated,
                "waited": waited,
                "not_replicated": list(status.not_replicated),
                "error": status.replication_error,
                "local": mgr.local_steps(),
            },
            f,
        )
    os._exit(0)  # the group lost a member: no teardown that would wait for it


@contextlib.contextmanager
def _unlistable_once(path: str) -> Iterator[None]:
    """The first listing of the directory ``path`` in this process fails with EIO."""
    from objckpt.writers.node_store import NodeStore

    real = NodeStore.entries
    failed: list[str] = []

    def entries(store: NodeStore, rel: str = "") -> Any:
        listed = os.path.join(store.root, rel)
        if not failed and os.path.abspath(listed) == os.path.abspath(path):
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), listed)
        return real(store, rel)

    with mock.patch.object(NodeStore, "entries", entries):
        yield


def discard_while_a_listing_fails(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """``discard_after(1)`` while node 1's listing of its tier fails once: the call
    raises on every rank, naming node 1's rank and its tier; called again, it
    discards step 2 everywhere and the load resumes from step 1."""
    mesh = _join(rank, world, init_file, o["per_node"])
    node = rank // o["per_node"]
    tier = os.path.join(o["local"], f"node{node}")
    try:
        with _manager(rank, url, o) as mgr:
            failing = _unlistable_once(tier) if node == 1 else contextlib.nullcontext()
            raised = None
            with failing:
                try:
                    mgr.discard_after(1)
                except objckpt.errors.ObjckptError as exc:
                    raised = str(exc)
            assert raised is not None, f"rank {rank}: discard_after(1) returned while node 1 "
            assert ("rank 2" in raised or "rank 3" in raised) and os.path.join(
                o["local"], "node1"
            ) in raised, raised
            assert mgr.discard_after(1) == [2], rank
            got = blank_tiered_state(mesh)
            assert mgr.load(got) == 1, rank
            assert torch.equal(got["model"]["w"].full_tensor(), full_state()["w"] + 1), rank
    finally:
        dist.destroy_process_group()


def discard_and_save_again(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Job B: ``discard_after(1)``, then a new step 2 (values ``full_state() + 202``),
    local only and replicated."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            assert mgr.discard_after(1) == [2], rank
            state = tiered_state(mesh, 202)
            state["step"] = 2
            assert mgr.save(2, state, promote=False).wait_replicated(), rank
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def restart_with_a_failing_sender(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Node 1 was lost: its files of step 2 come from node 0's replicas, and every
    read of a replica on node 0's sending side fails (EIO). Every rank loads the
    same fallback: step 1 (durable), bit-exact."""
    from objckpt.writers.node_store import NodeStore

    real = NodeStore.open_read

    def failing(store: NodeStore, rel: str) -> Any:
        path = os.path.join(store.root, rel)
        if "/replicas/" in path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real(store, rel)

    if rank // o["per_node"] == 0:
        NodeStore.open_read = failing  # type: ignore[method-assign]
    restart_and_load(rank, world, init_file, url, o)


def restart_counting_listings(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """``restart_and_load``, each rank writing how many times it listed its node's
    tier for the restore's decision to ``<local>/listings<rank>``."""
    from objckpt.ops.run import restore

    real = restore.list_holdings
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    with mock.patch.object(restore, "list_holdings", counted):
        restart_and_load(rank, world, init_file, url, o)
    with open(os.path.join(o["local"], f"listings{rank}"), "w") as f:
        f.write(str(len(calls)))


def restart_with_a_lost_listing(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """``restart_and_load`` while rank 2 (node 1's lister) cannot post its tier
    listing to the group's c10d store: rank 0 finds it missing at once, node 1 counts
    as unable to list, and every rank goes on to the same load."""
    from objckpt.ops.run import restore

    real = restore.group_store

    class Refusing:
        def __init__(self, store: Any) -> None:
            self._store = store

        def set(self, key: str, value: Any) -> None:
            if "/listing/" in key:
                raise RuntimeError("the c10d store refused the listing (injected)")
            self._store.set(key, value)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._store, name)

    def refusing(group: Any) -> Any:
        return Refusing(real(group))

    with contextlib.ExitStack() as stack:
        if rank == 2:
            stack.enter_context(mock.patch.object(restore, "group_store", refusing))
        restart_and_load(rank, world, init_file, url, o)
