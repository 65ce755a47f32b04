"""A lost node costs no progress: the local tier's replicas on other nodes (#39).

Real gloo ranks run as nodes of two (torchrun's environment set per rank), each
node's tier in its own directory, the root on moto behind the recording proxy, so
every store request of a restart is counted. Before replicas, losing a node's disk
between promotions sent the restart back to the newest durable step (step 1 here);
these tests fail that way on a tier without replicas.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import lost_node_ranks
from ranks import run_ranks, start_ranks

from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget


def _options(proxy: FaultProxy, local: Path, **extra: Any) -> dict[str, Any]:
    return {"storage": proxy.storage_options(), "local": str(local), "per_node": 2, **extra}


def _run(body: Any, world: int, tmp_path: Path, url: str, options: dict[str, Any]) -> None:
    init = tmp_path / f"init-{body.__name__}-{world}-{len(os.listdir(tmp_path))}"
    run_ranks(lost_node_ranks, body, world, str(init), url, options)


def _step_gets(proxy: FaultProxy, step: int) -> list[str]:
    return [p for p in proxy.paths("GetObject") if f"/{step_name(step)}/" in p]


def _payload_gets(proxy: FaultProxy) -> list[str]:
    return [p for p in proxy.paths("GetObject") if p.endswith(".distcp")]


def _names(path: Path) -> set[str]:
    return set(os.listdir(path)) if path.exists() else set()


def test_a_node_lost_between_promotions_resumes_from_the_newest_local_step_from_peers(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Step 1 durable, step 2 local only; node 1's disk is lost. The restart on a
    replacement node resumes from step 2, bit-exact, with no GET of step 2 at all and
    no payload GET from the store; afterwards the replacement holds node 0's
    replicas again (the next loss is covered too)."""
    local, url = tmp_path / "local", s3_bucket.url("lost-one")
    options = _options(s3_proxy, local, expect=2)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    node0_own = _names(local / "node0" / step_name(2))
    assert MANIFEST_KEY in _names(local / "node1" / "replicas" / step_name(2))  # node 0's part
    shutil.rmtree(local / "node1")
    s3_proxy.clear()
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)
    assert _step_gets(s3_proxy, 2) == []
    assert _payload_gets(s3_proxy) == []
    refilled = _names(local / "node1" / "replicas" / step_name(2))
    assert {k for k in node0_own if k.startswith("__0_") or k.startswith("__1_")} <= refilled
    assert any(k.startswith("__2_") for k in refilled)  # its own part, taken from node 0


def test_a_node_lost_and_a_restart_on_fewer_ranks_reshards_from_the_replicas(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1 lost, the job restarted on node 0 alone (2 ranks): step 2 loads,
    resharded, from node 0's own files and its replicas of node 1's; no payload GET."""
    local, url = tmp_path / "local", s3_bucket.url("lost-reshard")
    options = _options(s3_proxy, local, expect=2)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    shutil.rmtree(local / "node1")
    s3_proxy.clear()
    _run(lost_node_ranks.restart_and_load, 2, tmp_path, url, options)
    assert _step_gets(s3_proxy, 2) == []
    assert _payload_gets(s3_proxy) == []


def test_two_nodes_lost_at_two_replicas_fall_back_to_the_durable_step_naming_the_loss(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Three nodes, R = 2 (node g's replica on node g + 1): nodes 1 and 2 lost, so
    node 1's part of step 2 is on no node. The restart loads step 1 (durable),
    bit-exact, and warns naming step 2 and the ranks whose files are gone."""
    local, url = tmp_path / "local", s3_bucket.url("lost-two")
    options = _options(s3_proxy, local, expect=1)
    _run(lost_node_ranks.save_durable_then_local, 6, tmp_path, url, options)
    shutil.rmtree(local / "node1")
    shutil.rmtree(local / "node2")
    _run(lost_node_ranks.restart_and_load, 6, tmp_path, url, options)
    warnings = (local / "warnings.txt").read_text()
    assert "step 2 is committed on the local tier but no surviving node holds all of it" in (
        warnings
    )
    assert "rank(s) 2, 3 " in warnings  # node 1's ranks
    assert "loading step 1" in warnings


def test_a_full_peer_disk_leaves_the_step_committed_and_reported_not_replicated(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    local, url = tmp_path / "local", s3_bucket.url("peer-full")
    _run(lost_node_ranks.save_with_a_full_peer_disk, 4, tmp_path, url, _options(s3_proxy, local))
    # The failed replica left nothing behind on node 1, and step 3's is whole.
    assert not (local / "node1" / "replicas" / step_name(2)).exists() or not [
        n for n in os.listdir(local / "node1" / "replicas" / step_name(2)) if n.startswith("__0_")
    ]
    assert MANIFEST_KEY in _names(local / "node1" / "replicas" / step_name(3))


def test_local_retention_deletes_the_replicas_on_every_node(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    local, url = tmp_path / "local", s3_bucket.url("retention")
    _run(
        lost_node_ranks.save_three_keep_one,
        4,
        tmp_path,
        url,
        _options(s3_proxy, local, keep_last=1),
    )
    for node in ("node0", "node1"):
        assert _names(local / node / "replicas") == {step_name(3)}, node
        assert {n for n in _names(local / node) if n.startswith("step-")} == {step_name(3)}


def test_discard_after_deletes_the_replicas_above_the_step(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Without this, node 1's replica of the coordinator's manifest kept a discarded
    step committed on the nodes, and the restart loaded it."""
    local, url = tmp_path / "local", s3_bucket.url("discard")
    options = _options(s3_proxy, local)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    _run(lost_node_ranks.discard_local_step, 4, tmp_path, url, options)
    for node in ("node0", "node1"):
        assert step_name(2) not in _names(local / node / "replicas"), node
        assert step_name(2) not in _names(local / node), node


def test_discard_after_fails_on_every_rank_when_a_node_cannot_list_its_tier(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1's listing of its tier fails once (EIO) during ``discard_after(1)``.
    Before: every rank reported step 2 discarded while node 1 kept its replica of the
    manifest, and the next restart loaded step 2. Now the call raises on every rank
    (naming the rank and the tier); called again it discards step 2 everywhere."""
    local, url = tmp_path / "local", s3_bucket.url("discard-eio")
    options = _options(s3_proxy, local)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    _run(lost_node_ranks.discard_while_a_listing_fails, 4, tmp_path, url, options)
    for node in ("node0", "node1"):
        assert step_name(2) not in _names(local / node / "replicas"), node
        assert step_name(2) not in _names(local / node), node
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, {**options, "expect": 1})


def test_a_node_returning_with_a_discarded_step_never_brings_it_back(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Job A saves step 2 (local only); node 0 drops out with its disk intact; job B,
    on a replacement node, discards step 2 and saves a new step 2 (other values).
    Node 0 returns with its old disk. Before: the restart loaded the discarded step 2
    (the first manifest found). Now the holders' copies are compared with each other
    and with the root's rollback record: the new step 2 loads, and node 0's stale
    copy is named and deleted."""
    local, url = tmp_path / "local", s3_bucket.url("returning")
    options = _options(s3_proxy, local)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    os.rename(local / "node0", local / "node0-away")
    _run(lost_node_ranks.discard_and_save_again, 4, tmp_path, url, options)
    shutil.rmtree(local / "node0")
    os.rename(local / "node0-away", local / "node0")
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, {**options, "expect": 2, "value": 202})
    warnings = (local / "warnings.txt").read_text()
    assert "group-rank 0" in warnings and "discarded" in warnings, warnings
    # Again: the stale copy is gone, the new step 2 still loads.
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, {**options, "expect": 2, "value": 202})


def test_a_flipped_bit_in_the_only_copy_falls_back_to_the_durable_step_every_time(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1 lost; one bit flipped in node 0's copy of rank 1's payload of step 2
    (local only; its other copy was on node 1). Before: the CRC check caught it, then
    every restart raised ("rank 1 could not read the replicated items ... The
    specified key does not exist"). Now every restart loads step 1 (durable),
    warning which node held the bad copy."""
    local, url = tmp_path / "local", s3_bucket.url("flipped")
    options = _options(s3_proxy, local, expect=1)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    shutil.rmtree(local / "node1")
    payload = next(
        p
        for p in sorted((local / "node0" / step_name(2)).iterdir())
        if p.name.startswith("__1_") and p.name.endswith(".distcp")
    )
    blob = bytearray(payload.read_bytes())
    blob[100] ^= 0x10  # in the first item: the pickled "step", which every rank reads
    payload.write_bytes(bytes(blob))
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)
    warnings = (local / "warnings.txt").read_text()
    assert "group-rank 0" in warnings and payload.name in warnings, warnings
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)


def test_a_sender_failing_during_a_restore_ends_every_rank_on_the_same_fallback(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1 lost; node 0's reads of the replicas it is to send fail (EIO): every
    rank loads step 1 (durable), bit-exact, in the same load."""
    local, url = tmp_path / "local", s3_bucket.url("sender-fails")
    options = _options(s3_proxy, local, expect=1)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    shutil.rmtree(local / "node1")
    _run(lost_node_ranks.restart_with_a_failing_sender, 4, tmp_path, url, options)
    warnings = (local / "warnings.txt").read_text()
    assert "loading step 1" in warnings or "step 1" in warnings, warnings


def test_a_peer_dying_mid_transfer_never_hangs_the_others_and_the_step_stays_local(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Rank 3 exits while it receives step 1's replica. Ranks 0-2 end the same way
    within a bound (the peers' timeout, twice: the exchange, then the agreement):
    step 1 committed locally, reported not replicated, no hang."""
    local = tmp_path / "local"
    timeout = 10
    options = _options(s3_proxy, local, timeout=timeout)
    url = s3_bucket.url("peer-dies")
    ctx = start_ranks(
        lost_node_ranks, "peer_dies_mid_transfer", 4, str(tmp_path / "init"), url, options
    )
    for p in ctx.processes:
        p.join(timeout=240)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0, 0, 17], codes  # None: a rank hung
    outcomes = [json.loads((local / f"outcome{r}.json").read_text()) for r in range(3)]
    for r, out in enumerate(outcomes):
        assert out["replicated"] is False and out["not_replicated"] == [1], (r, out)
        assert out["local"] == [1], (r, out)
        assert out["waited"] < 4 * timeout + 30, (r, out)
        assert out["error"], (r, out)


def test_one_holders_unreadable_manifest_never_blocks_the_step(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1's replica of step 2's manifest is garbage (a damaged disk), node 0's own
    copy is whole: the restart sets node 1's copy aside and resumes from step 2.
    Before, one unusable copy made the step unusable on every restart (step 1)."""
    local, url = tmp_path / "local", s3_bucket.url("garbage-manifest")
    options = _options(s3_proxy, local, expect=2)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    (local / "node1" / "replicas" / step_name(2) / MANIFEST_KEY).write_bytes(b"{not json")
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)
    assert "unusable" in (local / "warnings.txt").read_text()


def test_a_reshard_on_fewer_nodes_moves_a_lost_nodes_bytes_between_the_survivors(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Three nodes of two ranks, R = 2 (node g's replica on node g + 1, so node 2's
    part is on node 0 only); node 2 lost and the job restarted on nodes 0 and 1 (4
    ranks). Resharded to 4, node 1's ranks need rows that saved rank 4 (node 2) wrote:
    node 0 sends them, and step 2 loads bit-exact with no payload GET."""
    local, url = tmp_path / "local", s3_bucket.url("reshard-moves")
    options = _options(s3_proxy, local, expect=2)
    _run(lost_node_ranks.save_durable_then_local, 6, tmp_path, url, options)
    node1 = _names(local / "node1" / step_name(2)) | _names(
        local / "node1" / "replicas" / step_name(2)
    )
    assert any(n.startswith("__2_") for n in node1)  # node 1's own part ...
    assert not any(n.startswith("__4_") for n in node1)  # ... and not node 2's
    assert any(n.startswith("__4_") for n in _names(local / "node0" / "replicas" / step_name(2)))
    shutil.rmtree(local / "node2")
    s3_proxy.clear()
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)
    assert _step_gets(s3_proxy, 2) == []
    assert _payload_gets(s3_proxy) == []


def test_a_restore_lists_each_nodes_tier_once_not_once_per_rank(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The ranks of a node share its tier: one of them lists it for rank 0's
    decision (before, every rank listed it and sent the same listing). Node 1 lost,
    3 nodes of 2 ranks: 3 listings, one per node, and step 2 loads from the peers."""
    local, url = tmp_path / "local", s3_bucket.url("one-listing")
    options = _options(s3_proxy, local, expect=2)
    _run(lost_node_ranks.save_durable_then_local, 6, tmp_path, url, options)
    shutil.rmtree(local / "node1")
    s3_proxy.clear()
    _run(lost_node_ranks.restart_counting_listings, 6, tmp_path, url, options)
    counts = [int((local / f"listings{r}").read_text()) for r in range(6)]
    assert [counts[r] + counts[r + 1] for r in (0, 2, 4)] == [1, 1, 1], counts
    assert _payload_gets(s3_proxy) == []


def test_ranks_of_a_node_with_their_own_tier_directories_each_list_theirs(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Each rank of a node has its own tier directory (``node<g>/r<l>``): one
    listing per node would miss local rank 1's files. No node lost: step 2 loads
    from the nodes, no payload GET."""
    local, url = tmp_path / "local", s3_bucket.url("own-dirs")
    options = _options(s3_proxy, local, expect=2, own_dirs=True)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    assert (local / "node1" / "r1" / step_name(2)).is_dir()
    s3_proxy.clear()
    _run(lost_node_ranks.restart_and_load, 4, tmp_path, url, options)
    assert _payload_gets(s3_proxy) == []


def test_a_listing_its_lister_cannot_post_never_stalls_the_restore(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1's lister cannot post its listing: rank 0 finds it missing at once
    (before, it waited on the key for the group's timeout while the other ranks timed
    out in the broadcast). Node 0 holds node 1's replicas, so step 2 still loads from
    the nodes on every rank, with no payload GET, and the failure is named."""
    local, url = tmp_path / "local", s3_bucket.url("lost-listing")
    options = _options(s3_proxy, local, expect=2, timeout=20)
    _run(lost_node_ranks.save_durable_then_local, 4, tmp_path, url, options)
    s3_proxy.clear()
    _run(lost_node_ranks.restart_with_a_lost_listing, 4, tmp_path, url, options)
    assert _payload_gets(s3_proxy) == []
    assert "could not post" in (local / "warnings.txt").read_text()
