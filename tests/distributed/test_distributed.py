"""Real torch.distributed (gloo) processes: world sizes 1, 2, 4 and resharding."""

from __future__ import annotations

import signal

import dist_helpers
import pytest
import torch
from helpers import fs_of, load, path_of
from ranks import run_ranks, start_ranks

from objckpt import Location, ObjectStoreReader
from objckpt.dcp.stock_metadata import load_stock_metadata
from objckpt.errors import CheckpointNotCommittedError
from objckpt.format.steps import step_name
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.testing import FaultProxy, MotoServer
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.base import PROBE_KEY


def _run(fn, world: int, tmp_path, url: str, options: dict) -> None:
    init_file = tmp_path / f"init-{fn.__name__}-{world}"
    args = (fn.__name__, world, str(init_file), url, options)
    run_ranks(dist_helpers, *args)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_save_and_load_at_world_size(world: int, s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url(f"ws{world}")
    _run(dist_helpers.save_sharded, world, tmp_path, url, s3_bucket.storage_options)
    reader = ObjectStoreReader(url, storage_options=s3_bucket.storage_options)
    assert reader.manifest is not None and reader.manifest.world_size == world
    _run(dist_helpers.load_sharded, world, tmp_path, url, s3_bucket.storage_options)


def test_reshard_save_on_4_load_on_2_and_1(s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url("reshard")
    _run(dist_helpers.save_sharded, 4, tmp_path, url, s3_bucket.storage_options)
    _run(dist_helpers.load_sharded, 2, tmp_path, url, s3_bucket.storage_options)
    # One process, no process group: the shards are assembled into plain tensors.
    expected = dist_helpers.full_state()
    state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(state, url, s3_bucket)
    for k, v in expected.items():
        assert torch.equal(state["model"][k], v), k
    assert state["step"] == 7


def test_sharded_tensor_with_two_local_shards_per_rank_round_trips(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """torch's own ShardedTensor layout with several chunks per rank (as in its
    test_file_system_checkpoint_cpu.py) saves and loads as stock DCP does: back into
    the same layout and into another one on 2 ranks, and assembled in one process."""
    url = s3_bucket.url("sharded-tensor")
    _run(dist_helpers.save_sharded_tensor, 2, tmp_path, url, s3_bucket.storage_options)
    _run(dist_helpers.load_sharded_tensor, 2, tmp_path, url, s3_bucket.storage_options)
    expected = dist_helpers.full_state()
    state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(state, url, s3_bucket)
    for k, v in expected.items():
        assert torch.equal(state["model"][k], v), k
    assert state["step"] == 7


def test_a_sync_save_proves_write_access_on_the_coordinator_only(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, tmp_path
) -> None:
    """A fresh writer per save (DCP's usual way) made every rank probe the bucket on every
    save: 3 requests x W per save. The coordinator's probe stands for the save."""
    url = s3_bucket.url("probe-once")
    _run(dist_helpers.save_sharded, 4, tmp_path, url, s3_proxy.storage_options())
    probes = [p for p in s3_proxy.paths("CreateMultipartUpload") if p.endswith(PROBE_KEY)]
    assert len(probes) == 1, probes
    aborts = [p for p in s3_proxy.paths("AbortMultipartUpload") if p.endswith(PROBE_KEY)]
    assert len(aborts) == 1, aborts
    reader = ObjectStoreReader(url, storage_options=s3_bucket.storage_options)
    assert reader.manifest is not None and reader.manifest.world_size == 4


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_and_nothing_commits(
    moto_iam_server: MotoServer, tmp_path
) -> None:
    """Without its own probe, rank 1 learns it cannot write from its first upload."""
    admin = moto_iam_server.storage_options()
    moto_iam_server.boto3_client().create_bucket(Bucket="ranks")
    read_only = moto_iam_server.add_user(
        "dist-read-only", ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"]
    )
    url = "s3://ranks/step-1"
    _run(dist_helpers.save_with_rank_options, 2, tmp_path, url, [admin, read_only])
    with pytest.raises(CheckpointNotCommittedError):
        ObjectStoreReader(url, storage_options=admin)
    client = moto_iam_server.boto3_client()
    assert not client.list_multipart_uploads(Bucket="ranks").get("Uploads")


@pytest.mark.parametrize("world", [2, 4])
def test_async_save_at_world_size(world: int, s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url(f"async-ws{world}")
    _run(dist_helpers.async_save_sharded, world, tmp_path, url, s3_bucket.storage_options)
    _run(dist_helpers.load_sharded, 2, tmp_path, url, s3_bucket.storage_options)


def test_async_save_names_a_rank_that_never_reports(s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url("silent")
    _run(dist_helpers.async_save_with_silent_rank, 2, tmp_path, url, s3_bucket.storage_options)
    with pytest.raises(FileNotFoundError):
        ObjectStoreReader(url, storage_options=s3_bucket.storage_options)


def test_queue_finalizes_only_when_every_rank_is_done(tmp_path) -> None:
    _run(dist_helpers.queue_across_ranks, 2, tmp_path, "", {})


@pytest.mark.parametrize("background", [False, True], ids=["staged-in-call", "background"])
def test_async_plan_cache_agrees_across_ranks(
    background: bool, s3_bucket: StoreTarget, tmp_path
) -> None:
    url = s3_bucket.url(f"cache-{background}")
    fn = dist_helpers.async_plan_cache_background if background else dist_helpers.async_plan_cache
    _run(fn, 2, tmp_path, url, s3_bucket.storage_options)
    expected = dist_helpers.full_state()
    attempts = set()
    for step in range(4):
        got = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": -1}
        if step >= 2:
            got["rank1_only"] = torch.zeros(3)
        reader = load(got, f"{url}/step-{step}", s3_bucket)
        assert reader.manifest is not None
        attempts.add(reader.manifest.attempt)
        assert got["step"] == step
        for k, v in expected.items():
            assert torch.equal(got["model"][k], v + step), (step, k)
        if step >= 2:
            assert torch.equal(got["rank1_only"], torch.full((3,), float(step)))
    assert len(attempts) == 4
    # The refused save uploaded nothing on either rank.
    assert not fs_of(s3_bucket).exists(path_of(s3_bucket, f"{url}/refused"))


def test_manager_on_every_rank(s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url("managed")
    _run(dist_helpers.manager_across_ranks, 2, tmp_path, url, s3_bucket.storage_options)
    fs = fs_of(s3_bucket)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path_of(s3_bucket, url), detail=False))
    assert names == ["step-0000000002", "step-0000000003"]


def test_manager_on_every_rank_with_persistent_prefixes(s3_bucket: StoreTarget, tmp_path) -> None:
    """Two ranks, rank 0's helper process committing: every payload in a spread
    directory in front of its step, retention takes step 1's, and step 3 loads."""
    url = s3_bucket.url("spread")
    _run(dist_helpers.manager_across_ranks_spread, 2, tmp_path, url, s3_bucket.storage_options)
    fs = fs_of(s3_bucket)
    root = path_of(s3_bucket, url)
    keys = sorted(p[len(root) + 1 :] for p in fs.find(root))
    payloads = [k for k in keys if k.endswith(".distcp")]
    assert {k.split("/")[1] for k in payloads} == {step_name(2), step_name(3)}, keys
    assert all(k.startswith("spread-") for k in payloads), keys
    assert {k.split("/")[0] for k in keys if k.startswith("step-")} == {
        step_name(2),
        step_name(3),
    }
    # Step 3's .metadata (step 2's renamed by the helper: the same plan) names step 3's
    # own objects, which a stock reader then opens.
    for step in (2, 3):
        data = fs.cat_file(f"{root}/{step_name(step)}/.metadata")
        paths = {i.relative_path for i in load_stock_metadata(data, url=url).storage_data.values()}
        assert paths and all(p.startswith("../spread-") for p in paths), paths
        assert all(f"/{step_name(step)}/" in p for p in paths), (step, paths)


def test_coordinator_killed_before_commit(s3_bucket: StoreTarget, tmp_path) -> None:
    """kill -9 of rank 0 between the uploads and the commit: the other rank reports an
    error naming rank 0 in bounded time, the step never becomes visible, the previous
    step still loads, and gc removes the orphaned objects."""
    url = s3_bucket.url("coordinator")
    init_file = str(tmp_path / "init-killed-coordinator")
    procs = start_ranks(
        dist_helpers,
        "async_save_with_killed_coordinator",
        2,
        init_file,
        url,
        s3_bucket.storage_options,
    ).processes
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [-signal.SIGKILL, 0], codes
    verdict = (tmp_path / "init-killed-coordinator.rank1").read_text()
    assert "rank0" in verdict and f"{url}/{step_name(2)}" in verdict, verdict

    with pytest.raises(CheckpointNotCommittedError):
        ObjectStoreReader(f"{url}/{step_name(2)}", storage_options=s3_bucket.storage_options)
    expected = dist_helpers.full_state()
    state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(state, f"{url}/{step_name(1)}", s3_bucket)
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())

    root = Location.parse(url, s3_bucket.storage_options)
    report = collect_garbage(root, grace=0, dry_run=False)
    assert any(step_name(2) in d for d in report.deleted), report
    assert fs_of(s3_bucket).find(path_of(s3_bucket, f"{url}/{step_name(2)}")) == []
