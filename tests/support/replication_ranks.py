"""Rank bodies of the replication tests: every step settles the same way on every rank.

Each rank sets torchrun's environment for itself (``GROUP_RANK = rank // per_node``)
and keeps its node's tier in ``<local>/node<GROUP_RANK>``, as in
:mod:`lost_node_ranks`. Each body writes what every rank saw to
``<local>/outcome<rank>.json``, so the test compares the ranks' answers (no
divergent outcome) besides asserting inside the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any
from unittest import mock

import torch.distributed as dist
from dist_helpers import tiered_state
from lost_node_ranks import _full_under, _join

import objckpt
from objckpt.format.steps import step_name
from objckpt.ops.tier.peers import PeerGroup, _Incoming
from objckpt.ops.tier.replication import PeerReplicator


def _manager(rank: int, url: str, o: dict[str, Any]) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        url,
        storage_options=o.get("storage"),
        async_options=objckpt.AsyncOptions(
            workers=1,
            barrier_timeout=o.get("timeout", 60),
            max_saves_in_flight=o.get("in_flight", 1),
        ),
        local=objckpt.LocalTier(
            os.path.join(o["local"], f"node{rank // o['per_node']}"),
            retention=objckpt.RetentionPolicy(keep_last=o.get("keep_last", 3)),
            promote_every=100,  # nothing is promoted: every step is local only
            replicas=o.get("replicas", 2),
            replication_timeout=o.get("replication_timeout", o.get("timeout", 60)),
        ),
    )


def _write_outcome(o: dict[str, Any], rank: int, outcome: dict[str, Any]) -> None:
    with open(os.path.join(o["local"], f"outcome{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _status(mgr: objckpt.CheckpointManager) -> dict[str, Any]:
    s = mgr.tier_status()
    return {
        "not_replicated": list(s.not_replicated),
        "replicated_latest": s.replicated_latest,
        "error": s.replication_error,
        "local": mgr.local_steps(),
    }


def index_write_fails_on_one_rank(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Rank 3's write of its step-2 index object fails (ENOSPC); steps 1-3 saved.
    Every rank settles step 2 as not replicated (naming rank 3), and steps 1 and 3
    as replicated: the ranks stay in step."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            one = mgr.save(1, tiered_state(mesh, 1))
            one.result()
            failing = _full_under(f"{step_name(2)}/.__index_3") if rank == 3 else None
            with failing or contextlib.nullcontext():
                two = mgr.save(2, tiered_state(mesh, 2))
                two.result()  # committed locally: the index failure is replication's
            second = two.wait_replicated(timeout=120)
            error_two = mgr.tier_status().replication_error
            three = mgr.save(3, tiered_state(mesh, 3))
            got = [one.wait_replicated(timeout=120), second, three.wait_replicated(timeout=120)]
            mgr.wait_until_finished()
            _write_outcome(o, rank, {"replicated": got, "error_two": error_two, **_status(mgr)})
    finally:
        dist.destroy_process_group()


def commits_end_out_of_order(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """``max_saves_in_flight=2``: rank 3's step-1 local commit ends only after its step-2
    one did (its step-1 index write waits for step 2's handle). Both steps are
    replicated on every rank, each step's files under its own name."""
    mesh = _join(rank, world, init_file, o["per_node"])
    released = threading.Event()
    real_open = open

    def held(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if f"{step_name(1)}/.__index_3" in os.fspath(path):
            released.wait(120)
        return real_open(path, mode, *args, **kwargs)

    try:
        with _manager(rank, url, o) as mgr:
            with mock.patch("builtins.open", held) if rank == 3 else contextlib.nullcontext():
                one = mgr.save(1, tiered_state(mesh, 1))
                two = mgr.save(2, tiered_state(mesh, 2))
                if rank == 3:
                    two.result(120)  # step 2's local commit ended on rank 3 ...
                    assert not one.done(), "step 1 ended first: the test shows nothing"
                released.set()  # ... before step 1's
                got = [h.wait_replicated(timeout=120) for h in (one, two)]
            mgr.wait_until_finished()
            _write_outcome(o, rank, {"replicated": got, **_status(mgr)})
    finally:
        dist.destroy_process_group()


def slow_receiver_many_saves(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """``keep_last=1``; rank 1 receives step 1 slowly (its first write waits until
    all 8 saves have committed locally). Meanwhile at most ``max_saves_in_flight`` steps
    wait to replicate, so the disk holds few steps; the steps beyond that are
    reported not replicated at once, alike on every rank; once the receiver goes
    on and the manager is finished, only the newest step is left on every node."""
    mesh = _join(rank, world, init_file, o["per_node"])
    released = threading.Event()
    real_write = _Incoming.write

    def slow(self: Any, i: int, data: memoryview) -> None:
        released.wait(120)
        real_write(self, i, data)

    try:
        with _manager(rank, url, o) as mgr:
            stall = mock.patch.object(_Incoming, "write", slow)
            with stall if rank == 1 else contextlib.nullcontext():
                handles = []
                for step in range(1, 9):
                    handles.append(mgr.save(step, tiered_state(mesh, step)))
                    handles[-1].result(120)
                node = os.path.join(o["local"], f"node{rank // o['per_node']}")
                held = sorted(d for d in os.listdir(node) if d.startswith("step-"))
                during = {"steps_on_disk": held, "local": mgr.local_steps()}
                released.set()
                got = [h.wait_replicated(timeout=120) for h in handles]
            mgr.wait_until_finished()
            after_wait = mgr.local_steps()
        after_close = sorted(d for d in os.listdir(node) if d.startswith("step-"))
        replicas = os.path.join(node, "replicas")
        kept_replicas = sorted(os.listdir(replicas)) if os.path.isdir(replicas) else []
        _write_outcome(
            o,
            rank,
            {
                "replicated": got,
                "during": during,
                "after_wait": after_wait,
                "after_close": after_close,
                "replicas_after_close": kept_replicas,
            },
        )
    finally:
        dist.destroy_process_group()


def one_rank_silent(rank: int, world: int, init_file: str, url: str, o: dict[str, Any]) -> None:
    """Three nodes of one rank; rank 2's replication of step 1 says nothing until
    ranks 0 and 1 gave up on their exchanges. Every rank reports step 1 not
    replicated naming rank 2 (the one waited on), replication goes off on every
    rank at once, and step 2 is reported not replicated at once, alike."""
    mesh = _join(rank, world, init_file, o["per_node"])
    flags = o["local"]
    real_agree = PeerReplicator._agree
    real_exchange = PeerGroup.exchange

    def agree(self: Any, seq: int, phase: str, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 1 and phase == "done" and rank != 2:  # its exchanges ended: tell rank 2
            open(os.path.join(flags, f"gave-up{rank}"), "w").close()
        return real_agree(self, seq, phase, step, *args, **kwargs)

    def silent(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("step") == 1:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(flags, f"gave-up{r}")) for r in (0, 1)
            ):
                time.sleep(0.05)  # polls the other ranks' flags (an event across processes)
        return real_exchange(self, *args, **kwargs)

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(PeerReplicator, "_agree", agree))
            if rank == 2:
                stack.enter_context(mock.patch.object(PeerGroup, "exchange", silent))
            with _manager(rank, url, o) as mgr:
                one = mgr.save(1, tiered_state(mesh, 1))
                first = one.wait_replicated(timeout=120)
                error_one = mgr.tier_status().replication_error
                two = mgr.save(2, tiered_state(mesh, 2))
                second = two.wait_replicated(timeout=120)
                mgr.wait_until_finished()
                _write_outcome(
                    o, rank, {"replicated": [first, second], "error_one": error_one, **_status(mgr)}
                )
    finally:
        dist.destroy_process_group()


def refill_after_damage(rank: int, world: int, init_file: str, url: str, o: dict[str, Any]) -> None:
    """Two nodes of one rank. Step 1 replicated; then one bit of node 0's own payload
    flips, and a refill of step 1 runs on both ranks (as after a restore that took a
    replaced node's part from its peers): the refill is not replicated, and node 1's
    good replica is not overwritten with the damaged bytes."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            assert mgr.save(1, tiered_state(mesh, 1)).wait_replicated(timeout=120), rank
            dist.barrier()
            if rank == 0:
                own = os.path.join(o["local"], "node0", step_name(1))
                payload = sorted(k for k in os.listdir(own) if k.endswith(".distcp"))[0]
                with open(os.path.join(own, payload), "r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0x01]))
            dist.barrier()
            local = mgr._saves.local
            assert local is not None and local._replicator is not None
            refilled = local._replicator.refill(1).result(120)
            mgr.wait_until_finished()
            _write_outcome(o, rank, {"refilled": refilled, **_status(mgr)})
    finally:
        dist.destroy_process_group()


def save_local_three_replicas(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Three nodes, ``replicas=3``: step 1 durable, step 2 local only, each node's files
    held by both other nodes."""
    mesh = _join(rank, world, init_file, o["per_node"])
    try:
        with _manager(rank, url, o) as mgr:
            one = mgr.save(1, tiered_state(mesh, 1), promote=True)
            two = mgr.save(2, tiered_state(mesh, 2), promote=False)
            assert one.wait_durable() and one.wait_replicated(timeout=120), rank
            assert two.wait_replicated(timeout=120), rank
            mgr.wait_until_finished()
            status = mgr.tier_status()
            assert status.replicas == 3 and status.replicated_latest == 2, (rank, status)
    finally:
        dist.destroy_process_group()


def slow_pair_within_the_bound(
    rank: int, world: int, init_file: str, url: str, o: dict[str, Any]
) -> None:
    """Rank 3 receives step 1 slowly: its first chunk lands ``barrier_timeout`` + 1 s
    late (the injected fault is the delay itself), well inside the step's bound
    (``replication_timeout``). Before, each message had ``barrier_timeout`` and the
    other ranks gave up in the agreement after it, turning replication off for the
    job. Now every rank waits for the slow pair within the bound: steps 1 and 2 are
    replicated on every rank and replication stays on."""
    mesh = _join(rank, world, init_file, o["per_node"])
    real_write = _Incoming.write
    late = threading.Event()  # set after the first wait: only the first chunk is late

    def slow(self: Any, i: int, data: memoryview) -> None:
        if not late.is_set():
            late.wait(o["timeout"] + 1)
            late.set()
        real_write(self, i, data)

    try:
        with _manager(rank, url, o) as mgr:
            stall = mock.patch.object(_Incoming, "write", slow)
            with stall if rank == 3 else contextlib.nullcontext():
                one = mgr.save(1, tiered_state(mesh, 1))
                first = one.wait_replicated()
            two = mgr.save(2, tiered_state(mesh, 2))
            second = two.wait_replicated()
            mgr.wait_until_finished()
            _write_outcome(o, rank, {"replicated": [first, second], **_status(mgr)})
    finally:
        dist.destroy_process_group()
