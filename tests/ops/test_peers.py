"""The peers of a local tier with replicas: the node map, the rounds, the wire.

The distributed behaviour (a lost node, a full peer disk, a peer dying) is shown
end to end in ``tests/distributed/test_lost_node.py``; here each piece is
checked on its own, with two real gloo ranks for the wire: what crosses is
checked (CRC32C) before it is kept, a failure on one side is reported on both and
leaves no file, and names a peer sends are refused unless objckpt writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import peer_ranks
import pytest
from ranks import run_ranks

from objckpt.errors import ObjckptError
from objckpt.ops.tier.peers import NodeMap, Transfer, _safe_key, list_holdings, rounds

A = "0123456789abcdef"


def _map(per_node: list[int]) -> NodeMap:
    node_of = tuple(n for n, count in enumerate(per_node) for _ in range(count))
    local_of = tuple(i for count in per_node for i in range(count))
    return NodeMap(tuple(f"group-rank {n}" for n in range(len(per_node))), node_of, local_of)


def test_each_round_pairs_every_rank_with_the_same_local_rank_on_the_jumped_node() -> None:
    nodes = _map([2, 2, 2, 2])
    (first,) = nodes.rounds_for(replicas=2, jump=1)
    assert first == {0: 2, 1: 3, 2: 4, 3: 5, 4: 6, 5: 7, 6: 0, 7: 1}
    (rack,) = nodes.rounds_for(replicas=2, jump=2)  # racks of two nodes: the other rack
    assert rack == {0: 4, 1: 5, 2: 6, 3: 7, 4: 0, 5: 1, 6: 2, 7: 3}
    assert len(nodes.rounds_for(replicas=3, jump=1)) == 2
    assert nodes.effective_replicas(3, 1) == 3


def test_a_jump_that_comes_back_to_the_node_gives_fewer_replicas_not_a_self_copy() -> None:
    nodes = _map([1, 1])
    assert nodes.rounds_for(replicas=3, jump=1) == [{0: 1, 1: 0}]  # k=2 is the node itself
    assert nodes.rounds_for(replicas=2, jump=2) == []
    assert nodes.effective_replicas(3, 1) == 2
    assert _map([4]).rounds_for(replicas=2, jump=1) == []  # one node: nowhere to send


def test_rounds_never_give_a_rank_two_streams_of_one_direction() -> None:
    transfers = [Transfer(1, 0, ("a",)), Transfer(2, 0, ("b",)), Transfer(1, 3, ("c",))]
    transfers += [Transfer(3, 2, ("d",)), Transfer(0, 1, ("e",))]
    batches = rounds(transfers)
    for batch in batches:
        assert len({t.src for t in batch}) == len(batch)
        assert len({t.dst for t in batch}) == len(batch)
    assert sorted(t.keys for b in batches for t in b) == sorted(t.keys for t in transfers)
    assert batches[0][0] == transfers[0]  # the order is kept: every rank walks the same


@pytest.mark.parametrize(
    "key",
    [
        "../step-0000000001/__0_0.0123456789abcdef.distcp",
        "/etc/passwd",
        "notes.txt",
        "sub/dir/__0_0.0123456789abcdef.distcp",
        "zz/__0_0.0123456789abcdef.distcp",
        "__0_0.0123456789abcdef.distcp\n",  # a regex's $ matches before a final newline
        "__index_0.0123456789abcdef.json\n",
        "3f\n/__0_0.0123456789abcdef.distcp",
        "__0_0.0123456789abcdef.distcp.objckpt-piece-0-00001\n",
        3,
    ],
)
def test_a_peer_cannot_name_a_file_objckpt_never_writes(key: object) -> None:
    with pytest.raises(ObjckptError, match="a peer sent"):
        _safe_key(key)


def test_names_objckpt_writes_pass() -> None:
    for key in (
        f"__0_0.{A}.distcp",
        f"3f/__1_2.{A}.distcp",
        f"__index_4.{A}.json",
        "manifest.json",
        ".metadata",
    ):
        assert _safe_key(key) == key


def test_holdings_list_own_files_and_replicas_and_never_follow_a_link(tmp_path: Path) -> None:
    own = tmp_path / "step-0000000002"
    own.mkdir()
    (own / f"__0_0.{A}.distcp").write_bytes(b"x" * 5)
    (own / "manifest.json").write_bytes(b"{}")
    (own / "notes.txt").write_bytes(b"not ours")
    rep = tmp_path / "replicas" / "step-0000000002"
    rep.mkdir(parents=True)
    (rep / f"__2_0.{A}.distcp").write_bytes(b"y" * 7)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"__9_0.{A}.distcp").write_bytes(b"z")
    (tmp_path / "step-0000000003").symlink_to(elsewhere)
    held = list_holdings(str(tmp_path))
    assert held.error is None
    assert dict(held.objects[2]) == {f"__0_0.{A}.distcp": 5, f"__2_0.{A}.distcp": 7}
    assert held.manifests == {2: b"{}"}
    assert 3 not in held.objects


def _prepare(base: Path) -> dict[int, dict[str, bytes]]:
    sent = {}
    for rank in (0, 1):
        own = base / f"own{rank}"
        own.mkdir(parents=True)
        files = {
            f"__{rank}_0.{A}.distcp": peer_ranks.payload(peer_ranks.LARGE, rank),
            f"__index_{rank}.{A}.json": b'{"rank": %d}' % rank,
            f"__{rank}_1.{A}.distcp": b"",
        }
        for k, v in files.items():
            (own / k).write_bytes(v)
        sent[rank] = files
    return sent


def _swap(
    base: Path,
    fault: dict[str, str],
    into_of: dict[str, str] | None = None,
    timeout: float = 60,
) -> dict[int, dict]:
    """Both ranks exchange their files at once (``fault``: rank -> what breaks, see
    :func:`peer_ranks.swap_files`); what each rank's ``exchange`` returned (a rank
    that died has no entry)."""
    args = (str(base / "init"), str(base), fault, into_of, timeout)
    run_ranks(peer_ranks, peer_ranks.swap_files, 2, *args)
    out = {}
    for r in (0, 1):
        if (base / f"result{r}.json").exists():
            out[r] = json.loads((base / f"result{r}.json").read_text())
    return out


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_both_ranks_send_and_keep_each_others_files_at_once(tmp_path: Path) -> None:
    sent = _prepare(tmp_path)
    results = _swap(tmp_path, {})
    for rank in (0, 1):
        other = 1 - rank
        assert results[rank]["sent"] is None and results[rank]["received"] is None
        assert sorted(results[rank]["kept"]) == sorted(sent[other])
        for key, data in sent[other].items():
            assert (tmp_path / f"into{rank}" / key).read_bytes() == data  # bit-exact, 3 chunks


def test_a_read_error_on_the_sender_is_reported_on_both_sides_and_nothing_is_kept(
    tmp_path: Path,
) -> None:
    _prepare(tmp_path)
    results = _swap(tmp_path, {"1": "read"})
    assert results[1]["sent"] is not None  # rank 1 learns rank 0 kept none of it
    assert "could not read" in results[0]["received"]
    assert results[0]["kept"] == []
    assert not (tmp_path / "into0").exists() or os.listdir(tmp_path / "into0") == []
    assert results[0]["sent"] is None and results[1]["received"] is None  # the other way is fine


def test_a_full_disk_on_the_receiver_fails_its_side_only_and_the_sender_hears_why(
    tmp_path: Path,
) -> None:
    _prepare(tmp_path)
    results = _swap(tmp_path, {"0": "full"})
    assert "No space left" in results[0]["received"]
    assert "No space left" in results[1]["sent"]  # the ack carries the receiver's error
    assert results[0]["kept"] == [] and results[1]["received"] is None
    leftovers = [n for n in os.listdir(tmp_path / "into0")] if (tmp_path / "into0").exists() else []
    assert leftovers == []


def test_a_failed_read_mid_file_leaves_no_partial_file_on_the_receiver(tmp_path: Path) -> None:
    _prepare(tmp_path)
    results = _swap(tmp_path, {"1": "read-late"})
    assert "could not read" in results[0]["received"] and results[0]["kept"] == []
    assert _files_under(tmp_path / "into0") == []  # neither a file nor a .tmp


def test_a_peer_dying_mid_transfer_leaves_no_partial_file(tmp_path: Path) -> None:
    """Rank 1 exits after its second received chunk, so rank 0 has written its first
    chunk into a temporary file; rank 0's exchange raises (no answer) and removes it."""
    _prepare(tmp_path)
    results = _swap(tmp_path, {"1": "die"}, timeout=20)
    assert 1 not in results
    assert "raised" in results[0]
    assert _files_under(tmp_path / "into0") == []


@pytest.mark.parametrize("link", ["replicas", "replicas/step-0000000005"])
def test_a_link_in_the_replicas_path_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, link: str
) -> None:
    """A link at ``<tier>/replicas`` or at the step's replica directory: the tier
    does not keep the step (the error names the link), the sender hears it, and the
    directory the link points to stays empty."""
    _prepare(tmp_path)
    tier = tmp_path / "tier0"
    outside = tmp_path / "outside"
    outside.mkdir()
    where = tier / link
    where.parent.mkdir(parents=True)
    where.symlink_to(outside, target_is_directory=True)
    into = str(tier / "replicas" / "step-0000000005")
    results = _swap(tmp_path, {}, into_of={"0": into})
    assert results[0]["kept"] == []
    assert "symbolic link" in results[0]["received"] and str(where) in results[0]["received"]
    assert "symbolic link" in results[1]["sent"]  # the sender hears why
    assert _files_under(outside) == []
    assert results[1]["received"] is None  # the other direction is unaffected


@pytest.mark.parametrize("craft", ["length:-5", f"length:{1 << 40}", "size:-1", f"size:{1 << 45}"])
def test_a_crafted_header_is_refused_without_allocating_what_it_announces(
    tmp_path: Path, craft: str
) -> None:
    """Rank 1 announces a header of a negative or huge length, or lists a file of a
    negative or huge size: rank 0 raises (the pair is broken, as with a dead peer)
    naming what it refused, before allocating or planning what was announced."""
    _prepare(tmp_path)
    results = _swap(tmp_path, {"1": craft}, timeout=10)
    assert results[1] == {"crafted": True, **{k: results[1][k] for k in ("peak", "allocated")}}
    raised = results[0].get("raised", "")
    assert "PeerWireError" in raised and craft.split(":")[1] in raised, results[0]
    assert max(results[0]["allocated"], default=0) <= 1 << 20
    assert results[0]["peak"] < 4 << 20, results[0]["peak"]  # no chunk plan of 2**21 entries
    assert _files_under(tmp_path / "into0") == []


def test_an_exchange_holds_one_chunk_buffer_per_direction(tmp_path: Path) -> None:
    """Both ranks send and receive a file of three chunks: each allocates one receive
    buffer of at most a chunk (torch) and nothing chunk-sized in Python (tracemalloc),
    however many chunks cross."""
    _prepare(tmp_path)
    results = _swap(tmp_path, {})
    for rank in (0, 1):
        big = [n for n in results[rank]["allocated"] if n > 1 << 20]
        assert len(big) <= 2 and sum(big) <= 2 * peer_ranks.CHUNK, big  # send + receive
        assert results[rank]["peak"] < 2 << 20, results[rank]["peak"]
