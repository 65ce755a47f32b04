"""Replicated means restorable: every step settles the same way on every rank (#44).

Real gloo ranks run as nodes (torchrun's environment set per rank), each node's tier
in its own directory; the root is a local directory (replication never touches the
store). Each rank writes what it saw; the tests compare the ranks' answers, so a
divergent outcome fails as surely as a wrong one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lost_node_ranks
import replication_ranks
from ranks import run_ranks

from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.manifest import Manifest
from objckpt.format.steps import step_name


def _run(module: Any, body: Any, world: int, tmp_path: Path, o: dict[str, Any]) -> None:
    init = tmp_path / f"init-{body.__name__}-{len(list(tmp_path.iterdir()))}"
    run_ranks(module, body, world, str(init), (tmp_path / "root").as_uri(), o)


def _outcomes(local: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((local / f"outcome{r}.json").read_text()) for r in range(world)]


def _options(local: Path, **extra: Any) -> dict[str, Any]:
    local.mkdir(parents=True, exist_ok=True)
    return {"storage": None, "local": str(local), "per_node": 2, **extra}


def _manifest_keys(local: Path, step: int) -> set[str]:
    data = (local / "node0" / step_name(step) / MANIFEST_KEY).read_bytes()
    return {o.key for o in Manifest.from_json_bytes(data, url="test").objects}


def _replica_keys(local: Path, node: int, step: int) -> set[str]:
    where = local / f"node{node}" / "replicas" / step_name(step)
    return {p.name for p in where.iterdir()} - {MANIFEST_KEY, METADATA_KEY}


def test_a_failed_index_write_on_one_rank_settles_that_step_alike_and_the_next_replicates(
    tmp_path: Path,
) -> None:
    """Rank 3's write of its step-2 index object fails (a full disk). Before, rank 3
    never submitted step 2: the ranks fell out of step (step 3's bytes paired with
    step 2's) and a restart after losing node 1 went back to step 1. Now every rank
    reports step 2 not replicated naming rank 3, steps 1 and 3 replicated, no replica
    directory holds another step's files, and the restart resumes from step 3."""
    local = tmp_path / "local"
    o = _options(local)
    _run(replication_ranks, replication_ranks.index_write_fails_on_one_rank, 4, tmp_path, o)
    outcomes = _outcomes(local, 4)
    for r, got in enumerate(outcomes):
        assert got["replicated"] == [True, False, True], (r, got)
        assert got["not_replicated"] == [2], (r, got)
        assert "rank 3" in (got["error_two"] or ""), (r, got["error_two"])
    for step in (1, 3):
        for node in (0, 1):
            assert _replica_keys(local, node, step) <= _manifest_keys(local, step), (node, step)
    shutil.rmtree(local / "node1")  # node 1 lost; the restart runs on a replacement
    lost = _options(local, expect=3)
    _run(lost_node_ranks, lost_node_ranks.restart_and_load, 4, tmp_path, lost)


def test_local_commits_ending_out_of_order_never_swap_steps(tmp_path: Path) -> None:
    """``max_in_flight=2`` and rank 3's step-1 commit ending after its step-2 one.
    Before, rank 3 exchanged step 2 first: ranks 1 and 3's files were swapped between
    ``replicas/step-1`` and ``replicas/step-2`` while every rank said both were
    replicated, and a restart after losing node 1 found nothing. Now both steps are
    replicated in save order, each replica directory holds only its step's objects,
    and the restart resumes from step 2."""
    local = tmp_path / "local"
    o = _options(local, in_flight=2)
    _run(replication_ranks, replication_ranks.commits_end_out_of_order, 4, tmp_path, o)
    for r, got in enumerate(_outcomes(local, 4)):
        assert got["replicated"] == [True, True], (r, got)
    for step in (1, 2):
        for node in (0, 1):
            assert _replica_keys(local, node, step) <= _manifest_keys(local, step), (node, step)
    shutil.rmtree(local / "node1")
    _run(lost_node_ranks, lost_node_ranks.restart_and_load, 4, tmp_path, _options(local, expect=2))


def test_a_slow_receiver_caps_the_steps_waiting_and_retires_them_when_replication_ends(
    tmp_path: Path,
) -> None:
    """``keep_last=1``, one receiver stalled while 8 saves commit. Before, retention
    spared every queued step (all 8 stayed on every node) and a spared step stayed
    after ``wait_until_finished()`` and ``close()``. Now at most ``max_in_flight``
    steps wait to replicate, the steps beyond are reported not replicated alike on
    every rank, and afterwards only the newest step is left."""
    local = tmp_path / "local"
    # The senders wait for the stalled receiver well past the 8 saves, however slow.
    o = _options(local, keep_last=1, replication_timeout=600)
    _run(replication_ranks, replication_ranks.slow_receiver_many_saves, 4, tmp_path, o)
    outcomes = _outcomes(local, 4)
    first = outcomes[0]["replicated"]
    assert first[0] is True and first.count(False) >= 1, first
    for r, got in enumerate(outcomes):
        assert got["replicated"] == first, (r, got["replicated"], first)  # one outcome
        # keep_last=1 (the newest), the step replicating and max_in_flight=1 waiting.
        assert len(got["during"]["steps_on_disk"]) <= 3, (r, got["during"])
        assert got["after_wait"] == [8], (r, got)
        assert got["after_close"] == [step_name(8)], (r, got)
        assert set(got["replicas_after_close"]) <= {step_name(8)}, (r, got)


def test_a_silent_rank_is_named_and_turns_replication_off_on_every_rank(
    tmp_path: Path,
) -> None:
    """Three nodes of one rank; rank 2 is silent in step 1's exchanges past the step's
    bound. Before, rank 0's error named rank 1 (the rank it sends to), and only the
    ranks whose wait failed turned replication off. Now every rank names rank 2,
    every rank reports both steps not replicated, and the step after is refused at
    once on every rank (replication off, agreed)."""
    local = tmp_path / "local"
    o = _options(local, per_node=1, replication_timeout=5)
    _run(replication_ranks, replication_ranks.one_rank_silent, 3, tmp_path, o)
    outcomes = _outcomes(local, 3)
    for r, got in enumerate(outcomes):
        assert got["replicated"] == [False, False], (r, got)
        assert "rank 2" in (got["error_one"] or ""), (r, got["error_one"])
        assert "rank 1 " not in (got["error_one"] or ""), (r, got["error_one"])
        assert "off" in (got["error"] or ""), (r, got["error"])


def test_a_slow_pair_within_the_steps_bound_replicates_and_turns_nothing_off(
    tmp_path: Path,
) -> None:
    """One receiver is late by more than ``barrier_timeout`` but within the step's
    bound. Before, the other ranks gave up after ``barrier_timeout`` in the agreement
    and turned replication off for every rank; now both steps are replicated alike on
    every rank and no error is recorded."""
    local = tmp_path / "local"
    o = _options(local, timeout=3, replication_timeout=120)
    _run(replication_ranks, replication_ranks.slow_pair_within_the_bound, 4, tmp_path, o)
    for r, got in enumerate(_outcomes(local, 4)):
        assert got["replicated"] == [True, True], (r, got)
        assert got["error"] is None and got["not_replicated"] == [], (r, got)
        assert got["replicated_latest"] == 2, (r, got)


def test_a_refill_never_spreads_a_damaged_copy(tmp_path: Path) -> None:
    """One bit flipped in node 0's own payload, then a refill of the step (as after a
    restore onto a replacement node). Before, the refill sent the damaged bytes with
    the CRC32C computed from the disk, and node 1 kept them as a good replica. Now
    each file travels with the manifest's CRC32C: node 1 refuses it, keeps its good
    replica, and the refill is reported not replicated on both ranks."""
    local = tmp_path / "local"
    o = _options(local, per_node=1)
    _run(replication_ranks, replication_ranks.refill_after_damage, 2, tmp_path, o)
    for r, got in enumerate(_outcomes(local, 2)):
        assert got["refilled"] is False, (r, got)
    own = local / "node0" / step_name(1)
    replica = local / "node1" / "replicas" / step_name(1)
    damaged = sorted(own.glob("*.distcp"))[0]
    good = (replica / damaged.name).read_bytes()
    assert good[0] ^ damaged.read_bytes()[0] == 0x01, "the replica took the damaged bytes"


def test_three_replicas_cover_two_lost_nodes(tmp_path: Path) -> None:
    """R = 3 on N = 3 nodes (2 * jump mod N != 0): nodes 1 and 2 lost together, the
    restart on replacements resumes from the local-only step 2, node 0 holding every
    node's files."""
    local = tmp_path / "local"
    o = _options(local, per_node=1, replicas=3)
    _run(replication_ranks, replication_ranks.save_local_three_replicas, 3, tmp_path, o)
    for node in (1, 2):
        shutil.rmtree(local / f"node{node}")
    again = _options(local, per_node=1, replicas=3, expect=2)
    _run(lost_node_ranks, lost_node_ranks.restart_and_load, 3, tmp_path, again)


def test_the_coordinators_node_lost_resumes_from_its_replicas(tmp_path: Path) -> None:
    """Node 0 (rank 0's, which alone keeps the manifest among the nodes' own files)
    lost between promotions: the restart on a replacement resumes from the local-only
    step 2, its manifest and node 0's part taken from node 1's replicas."""
    local = tmp_path / "local"
    o = _options(local, expect=2)
    _run(lost_node_ranks, lost_node_ranks.save_durable_then_local, 4, tmp_path, o)
    shutil.rmtree(local / "node0")
    _run(lost_node_ranks, lost_node_ranks.restart_and_load, 4, tmp_path, o)
