"""The local tier across real gloo ranks, each with its own local directory (as on
separate nodes) and its own recording proxy in front of moto, so every store request
is attributed to the rank that made it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import dist_helpers
import torch.multiprocessing as mp

from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import MotoServer, StoreTarget


def _run(fn, world: int, tmp_path, url: str, options: dict) -> None:
    init_file = tmp_path / f"init-{fn.__name__}-{world}"
    args = (fn.__name__, world, str(init_file), url, options)
    mp.spawn(dist_helpers.rank_main, args=args, nprocs=world, join=True)


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
