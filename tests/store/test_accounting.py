"""Request accounting: what objckpt says a save or load cost equals what the store saw."""

from __future__ import annotations

import torch
from helpers import load, save

from objckpt import CheckpointManager, UploadOptions
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.accounting import RequestStats

MiB = 1024 * 1024
PARTS = UploadOptions(part_size=5 * MiB, object_size=16 * MiB)


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(4 * MiB, generator=g), "small": torch.ones(10), "step": 4}


def _target(proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=proxy.storage_options())


def _assert_matches_the_wire(stats: RequestStats, proxy: FaultProxy, commit_puts: int) -> None:
    kinds = stats.requests
    assert kinds.get("UploadPart", 0) == proxy.count("UploadPart") > 0
    # The manifest's own PUT, and .metadata's after it, happen after its counts were written.
    assert kinds.get("PUT", 0) + commit_puts == proxy.count("PutObject")
    assert kinds.get("LIST", 0) == proxy.count("ListObjectsV2")
    uploaded = proxy.sent_bytes("UploadPart", "PutObject")
    assert stats.bytes_sent <= uploaded < stats.bytes_sent + 64 * 1024  # + the manifest


def test_a_sync_save_records_its_requests_in_the_manifest(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    writer = save(_state(), s3_bucket.url("c"), _target(s3_proxy, s3_bucket), upload=PARTS)
    manifest = writer.last_manifest
    assert manifest is not None and manifest.requests is not None
    _assert_matches_the_wire(manifest.requests, s3_proxy, commit_puts=2)
    assert manifest.requests.retries == 0 and manifest.requests.throttled == 0


def test_an_async_save_counts_its_workers_requests_and_the_load_its_own(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    target = _target(s3_proxy, s3_bucket)
    with CheckpointManager(target.root, storage_options=target.storage_options, upload=PARTS) as m:
        s3_proxy.clear()
        handle = m.save(1, _state())
        handle.result(timeout=120)
    total = handle.total_requests
    assert total is not None
    _assert_matches_the_wire(total, s3_proxy, commit_puts=2)
    # This rank did everything: its own count is the total plus the manifest and .metadata PUTs.
    assert handle.requests.requests["PUT"] == total.requests["PUT"] + 2
    s3_proxy.clear()
    state = {"big": torch.zeros(4 * MiB), "small": torch.zeros(10), "step": 0}
    reader = load(state, f"{target.root}/{step_name(1)}", target)
    assert reader.requests.requests["GET"] == s3_proxy.count("GetObject")
    assert reader.requests.bytes_received == s3_proxy.received_bytes("GetObject")


def test_503s_show_as_retries_and_throttling(s3_bucket: StoreTarget, s3_proxy: FaultProxy) -> None:
    s3_proxy.add(Rule("UploadPart", action="status", status=503, times=2))
    writer = save(_state(), s3_bucket.url("c"), _target(s3_proxy, s3_bucket), upload=PARTS)
    stats = writer.last_manifest.requests if writer.last_manifest else None
    assert stats is not None
    assert stats.throttled == 2 and stats.retries >= 2
    assert stats.requests["UploadPart"] == s3_proxy.count("UploadPart")


def test_a_load_by_checkpoint_id_reads_the_manifest_once(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """dcp.load(checkpoint_id=url, storage_reader=reader) resets the reader with the URL it
    was built for: the manifest is not fetched a second time. A later load of the same
    URL (which may have been overwritten since) reads it again."""
    import torch.distributed.checkpoint as dcp
    from helpers import quiet, save

    from objckpt import ObjectStoreReader

    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    url = target.url("once")
    save({"w": torch.ones(8)}, url, target)

    def manifest_gets() -> int:
        return sum(p.endswith("/manifest.json") for p in s3_proxy.paths("GetObject"))

    before = manifest_gets()
    reader = ObjectStoreReader(url, storage_options=target.storage_options)
    got = {"w": torch.zeros(8)}
    with quiet():
        dcp.load(got, checkpoint_id=url, storage_reader=reader)
    assert torch.equal(got["w"], torch.ones(8))
    assert manifest_gets() - before == 1
    with quiet():
        dcp.load(got, checkpoint_id=url, storage_reader=reader)
    assert manifest_gets() - before == 2  # a second load reads it again
