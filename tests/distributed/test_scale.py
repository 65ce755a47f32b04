"""Cost per rank that stays flat in the world size, shown on real gloo processes.

Each test counts what a recording proxy in front of the moto server saw (requests
and bytes by S3 operation), so "once per job" is checked on the wire, not inferred
from an end state.
"""

from __future__ import annotations

import json

import dist_scale
import pytest
import torch
from helpers import load
from ranks import run_ranks

from objckpt import CheckpointManager, ObjectStoreReader
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget

MiB = 1024 * 1024
WRITES = ("PutObject", "UploadPart")


def _run(fn, world: int, tmp_path, url: str, options: dict) -> None:
    init_file = tmp_path / f"init-{fn.__name__}-{world}"
    args = (fn.__name__, world, str(init_file), url, options)
    run_ranks(dist_scale, *args)


def _payload_ranks(s3_proxy: FaultProxy) -> set[int]:
    """Ranks whose payload objects the proxy saw being written (``__<rank>_<i>.…``)."""
    ranks = set()
    for op in ("PutObject", "CreateMultipartUpload"):
        for path in s3_proxy.paths(op):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("__") and name.endswith(".distcp"):
                ranks.add(int(name[2:].split("_", 1)[0]))
    return ranks


def test_replicated_state_is_uploaded_once_and_fetched_once(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    """DDP-style: 4 ranks hold the same 64 MiB. The upload carries it once, split
    across the replicas; the load GETs it once and broadcasts it."""
    url = s3_bucket.url("replicated")
    size = 64 * MiB
    opts = {"store": s3_proxy.storage_options()}
    _run(dist_scale.save_replicated, 4, tmp_path, url, opts)
    sent = s3_proxy.sent_bytes(*WRITES)
    assert size <= sent < 1.05 * size, f"uploaded {sent / MiB:.1f} MiB for {size / MiB} MiB"
    assert len(_payload_ranks(s3_proxy)) >= 3, "the replicas did not share the upload"
    s3_proxy.clear()
    _run(dist_scale.load_replicated, 4, tmp_path, url, opts)
    got = s3_proxy.received_bytes("GetObject")
    assert size <= got < 1.05 * size, f"fetched {got / MiB:.1f} MiB for {size / MiB} MiB"
    # Rank 0 alone lists: once when the managers start, once when load picks the step;
    # each time one LIST of the step directories and one HEAD of the step's manifest.
    assert s3_proxy.count("ListObjectsV2") == 2
    assert s3_proxy.count("HeadObject") == 2
    manifests = [p for p in s3_proxy.paths("GetObject") if p.endswith("/manifest.json")]
    assert len(manifests) == 1  # read once and broadcast
    # One process, no group: the slices assemble into the full tensors.
    expected = dist_scale.replicated_state()
    got_state = {k: torch.zeros_like(v) for k, v in expected.items()}
    load(got_state, f"{url}/{step_name(1)}", s3_bucket)
    assert all(torch.equal(got_state[k], v) for k, v in expected.items())
    # A plain dcp.load in the group takes the manager's read path: fetched once too.
    s3_proxy.clear()
    _run(dist_scale.load_replicated_dcp, 4, tmp_path, f"{url}/{step_name(1)}", opts)
    got = s3_proxy.received_bytes("GetObject")
    assert size <= got < 1.05 * size, f"dcp.load fetched {got / MiB:.1f} MiB for {size / MiB} MiB"


def test_hsdp_shard_and_replicate_written_once_and_resharded(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    """2 x 2 mesh (replicate x shard) with Shard and Replicate placements: each
    byte is written once; loads on 4, 2 and 1 processes are bit-exact."""
    url = s3_bucket.url("hsdp")
    size = sum(v.numel() * v.element_size() for v in dist_scale.hsdp_full().values())
    opts = {"store": s3_proxy.storage_options()}
    _run(dist_scale.save_hsdp, 4, tmp_path, url, opts)
    sent = s3_proxy.sent_bytes(*WRITES)
    assert size <= sent < 1.05 * size, f"uploaded {sent / MiB:.1f} MiB for {size / MiB:.1f}"
    s3_proxy.clear()
    _run(dist_scale.load_hsdp, 4, tmp_path, url, opts)
    got = s3_proxy.received_bytes("GetObject")
    assert size <= got < 1.05 * size, f"fetched {got / MiB:.1f} MiB for {size / MiB:.1f}"
    _run(dist_scale.load_hsdp, 2, tmp_path, url, opts)
    expected = dist_scale.hsdp_full()
    state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(state, f"{url}/{step_name(1)}", s3_bucket)
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())
    assert state["step"] == 11


def test_each_rank_fetches_only_its_index_object(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    url = s3_bucket.url("indexed")
    opts = {"store": s3_proxy.storage_options()}
    _run(dist_scale.save_sharded_with_manager, 4, tmp_path, url, opts)
    reader = ObjectStoreReader(f"{url}/{step_name(1)}", storage_options=s3_bucket.storage_options)
    assert reader.manifest is not None and reader.manifest.version == 2
    index_keys = reader._locator.index_keys if reader._locator else ()
    assert len([k for k in index_keys if k]) == 4
    s3_proxy.clear()
    _run(dist_scale.load_sharded_with_manager, 4, tmp_path, url, opts)
    gets = s3_proxy.paths("GetObject")
    assert len([p for p in gets if p.endswith("/manifest.json")]) == 1
    fetched = sorted(p.rsplit("/", 1)[-1] for p in gets if "/__index_" in p)
    assert fetched == sorted(index_keys), "a rank fetched another rank's index (or none)"


def test_all_ranks_load_the_same_step_while_one_commits(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server, tmp_path
) -> None:
    """Rank 1's listings are slow (stalled at its own s3_proxy) and a step commits right
    after the managers start. Only rank 0 lists; both ranks load the same step."""
    url = s3_bucket.url("agree")
    with CheckpointManager(url, storage_options=s3_bucket.storage_options) as mgr:
        mgr.save(1, {"w": torch.full((8,), 1.0)}).result(timeout=120)
    with FaultProxy(moto_server.endpoint_url) as slow:
        slow.add(Rule("ListObjectsV2", action="stall", stall=3.0))
        report = tmp_path / "agree"
        opts = {
            "ranks": [s3_proxy.storage_options(), slow.storage_options()],
            "report": str(report),
        }
        _run(dist_scale.latest_while_committing, 2, tmp_path, url, opts)
        assert slow.count("ListObjectsV2") == 0
    outcomes = [json.loads((tmp_path / f"agree.rank{r}").read_text()) for r in range(2)]
    assert outcomes[0] == outcomes[1] == {"step": 2, "value": 2.0}, outcomes


def test_a_request_failed_on_one_rank_is_not_finalized_on_another(tmp_path) -> None:
    _run(dist_scale.failed_request_not_finalized, 2, tmp_path, "", {})


def test_two_queues_in_one_job_do_not_see_each_others_keys(tmp_path) -> None:
    _run(dist_scale.two_queues, 2, tmp_path, "", {})


def test_c10d_keys_do_not_grow_over_20_saves(s3_bucket: StoreTarget, tmp_path) -> None:
    report = tmp_path / "keys"
    url = s3_bucket.url("keys")
    _run(
        dist_scale.c10d_keys_over_saves,
        2,
        tmp_path,
        url,
        {"store": s3_bucket.storage_options, "report": str(report)},
    )
    counts = json.loads((tmp_path / "keys.rank0").read_text())
    assert len(counts) == 20 and counts[-1] == counts[1], counts


@pytest.mark.parametrize("faults", [1, 2])
def test_a_503_on_a_listing_is_retried_not_read_as_empty(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, faults: int
) -> None:
    url = s3_bucket.url("listing")
    with CheckpointManager(url, storage_options=s3_bucket.storage_options) as mgr:
        mgr.save(3, {"w": torch.ones(4)}).result(timeout=120)
    s3_proxy.add(Rule("ListObjectsV2", action="status", status=503, times=faults))
    with CheckpointManager(url, storage_options=s3_proxy.storage_options()) as mgr:
        assert mgr.all_steps() == [3]
    assert s3_proxy.count("ListObjectsV2", faulted=True) == faults
