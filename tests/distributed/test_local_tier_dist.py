"""The local tier across real gloo ranks, each with its own local directory (as on
separate nodes) and its own recording proxy in front of moto, so every store request
is attributed to the rank that made it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import dist_helpers
import tier_ranks
from ranks import run_ranks

from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import MotoServer, StoreTarget


def _run(fn, world: int, tmp_path, url: str, options: dict) -> None:
    init_file = tmp_path / f"init-{fn.__name__}-{world}"
    args = (fn.__name__, world, str(init_file), url, options)
    run_ranks(dist_helpers, *args)


@contextlib.contextmanager
def _per_rank_proxies(moto: MotoServer, n: int, local: str) -> Iterator[tuple[list, dict]]:
    """A recording proxy per rank, and the options the rank bodies take (each rank's
    storage options through its own proxy, the local tier's parent directory)."""
    proxies = [FaultProxy(moto.endpoint_url) for _ in range(n)]
    try:
        yield proxies, {"per_rank": [p.storage_options() for p in proxies], "local": local}
    finally:
        for p in proxies:
            p.close()


def _step2(local: str, node: int) -> str:
    return os.path.join(local, f"node{node}", step_name(2))


def _fetched(proxy: FaultProxy) -> set[str]:
    """Names of the step-2 objects a rank read from the store."""
    return {p.rsplit("/", 1)[-1] for p in proxy.paths("GetObject") if f"/{step_name(2)}/" in p}


def test_restart_reads_only_what_each_node_lacks(
    moto_server: MotoServer, s3_bucket: StoreTarget, tmp_path
) -> None:
    """Save on 4 ranks to local + S3; node 2 loses its disk; restart on 4 and on 2:
    bit-exact, and each rank reads from S3 only objects its own directory lacks (on
    4 ranks: rank 2 alone reads, exactly its own part)."""
    local = str(tmp_path / "local")
    url = s3_bucket.url("tiered")
    with _per_rank_proxies(moto_server, 4, local) as (proxies, options):
        _run(dist_helpers.tiered_save, 4, tmp_path, url, options)
        held = {n: set(os.listdir(_step2(local, n))) for n in range(4)}
        assert MANIFEST_KEY in held[0]
        for n in range(4):  # each node holds its own payload and index object
            assert any(k.startswith(f"__{n}_") for k in held[n]), held[n]
            assert any(k.startswith(f"__index_{n}.") for k in held[n]), held[n]
        shutil.rmtree(os.path.join(local, "node2"))

        for p in proxies:
            p.clear()
        _run(dist_helpers.tiered_load, 4, tmp_path, url, options)
        fetched = [_fetched(p) for p in proxies]
        assert fetched[2] == {k for k in held[2] if k.startswith("__")}, fetched
        assert fetched[0] == set() and fetched[1] == set() and fetched[3] == set(), fetched

        for p in proxies:
            p.clear()
        _run(dist_helpers.tiered_load, 2, tmp_path, url, options)
        fetched = [_fetched(p) for p in proxies[:2]]
        for n in range(2):
            assert fetched[n], n  # nodes 2 and 3's parts are not on nodes 0 and 1
            assert not fetched[n] & held[n], (n, fetched[n] & held[n])
        # node 0 read the manifest from its own disk and shared it
        assert MANIFEST_KEY not in fetched[0] | fetched[1]


def test_one_full_local_disk_sends_every_rank_to_the_store(
    moto_server: MotoServer, s3_bucket: StoreTarget, tmp_path
) -> None:
    """The room check is agreed across ranks (one all-reduce): one rank short of room
    and the step goes to S3 on both, committed there as one checkpoint."""
    local = str(tmp_path / "local")
    url = s3_bucket.url("full")
    with _per_rank_proxies(moto_server, 2, local) as (proxies, options):
        _run(dist_helpers.tiered_one_rank_full, 2, tmp_path, url, options)
        for p in proxies:  # each rank uploaded its own part straight to S3
            assert any(".distcp" in path for path in p.paths("PutObject")), p.paths("PutObject")
        assert not os.path.exists(os.path.join(local, "node0", step_name(1)))


def _spawn(body: str, world: int, tmp_path, *args: object) -> None:
    init_file = tmp_path / f"init-{body}-{world}"
    run_ranks(tier_ranks, body, world, str(init_file), *args)


def _tier_files(local: str, world: int) -> dict[str, set[str]]:
    """Every file of every node's tier directory, by node and step directory."""
    out = {}
    for n in range(world):
        node = os.path.join(local, f"node{n}")
        for name in sorted(os.listdir(node)):
            out[f"node{n}/{name}"] = set(os.listdir(os.path.join(node, name)))
    return out


def _stray(local: str, node: int, step: int) -> str:
    """What a save killed before its local commit leaves on a node: a payload, no manifest."""
    path = os.path.join(
        local, f"node{node}", step_name(step), f"__{node}_0.0123456789abcdef.distcp"
    )
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    return os.path.dirname(path)


def test_a_restart_that_moves_rank_0_to_another_node_deletes_no_committed_step(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """Steps 1 and 3 are committed on the local tier only (their manifests on node 0,
    rank 0's node then), step 2 is durable. The job restarts with the ranks swapped
    onto each other's nodes: no node loses a file of steps 1-3, the leftovers of a
    killed save (step 9, committed nowhere) are still swept on both nodes, and the
    newest step every rank can load (2: rank 0's new node holds no manifest of 1 or 3)
    loads bit-exact."""
    local = str(tmp_path / "local")
    url = s3_bucket.url("moved")
    options = {"storage": s3_bucket.storage_options, "local": local}
    _spawn("save_three", 2, tmp_path, url, options)
    before = _tier_files(local, 2)
    assert MANIFEST_KEY in before[f"node0/{step_name(3)}"]
    assert MANIFEST_KEY not in before[f"node1/{step_name(3)}"]
    strays = [_stray(local, n, 9) for n in range(2)]
    _spawn("restart_and_load", 2, tmp_path, url, {**options, "swap": True, "expect": 2})
    assert not any(os.path.exists(s) for s in strays)
    assert _tier_files(local, 2) == before


def test_a_local_tier_one_rank_cannot_list_sweeps_nothing_on_any_rank(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """Rank 1's listing of its tier fails at start: no rank deletes anything (not even
    a killed save's leftovers), both start, and they load step 3 together."""
    local = str(tmp_path / "local")
    url = s3_bucket.url("unlisted")
    options = {"storage": s3_bucket.storage_options, "local": local}
    _spawn("save_three", 2, tmp_path, url, options)
    strays = [_stray(local, n, 9) for n in range(2)]
    before = _tier_files(local, 2)
    _spawn("restart_with_rank1_unable_to_list", 2, tmp_path, url, options)
    assert _tier_files(local, 2) == before
    assert all(os.path.exists(s) for s in strays)
