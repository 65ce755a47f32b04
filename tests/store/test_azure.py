"""Azure Blob (``az://`` through adlfs) end to end against Azurite (issue #36).

The store family's properties are in the conformance suite
(``tests/store/test_store_conformance.py::TestAzurite``); here is what a user sees: a
training loop's manager on ``az://``, the create-only commit refusing a second
writer, a commit whose answer was lost settled by reading it back, and a large
object that becomes visible whole or not at all.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from adlfs import AzureBlobFileSystem
from click.testing import CliRunner
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save

from objckpt import CheckpointManager, Location, RetentionPolicy, UploadOptions
from objckpt.cli import main
from objckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointExistsError,
    StoreRefusedError,
)
from objckpt.format.commit import commit_checkpoint
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.ops.maintain.verify import verify_checkpoint
from objckpt.testing import Azurite, FaultProxy, Rule
from objckpt.testing.azure_operations import azure_operation
from objckpt.testing.azurite import AZURITE_KEY
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import azure as azure_writers
from objckpt.writers import open_store, store_family
from objckpt.writers.azure import AzureStore, BlockUpload
from objckpt.writers.azureclient import RetryingAzureBlobFileSystem
from objckpt.writers.reads import SpanSink

MiB = 1024 * 1024
NOT_ATOMIC = "check-then-write that is not atomic"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 64, generator=g),
        "big": torch.randn(3 * MiB, generator=g),  # 12 MiB: staged blocks at 5 MiB parts
        "nested": {"b": torch.arange(5) * step},
        "step": step,
    }


def _names(azurite: Azurite, container: str, prefix: str) -> list[str]:
    with azurite.blob_service_client() as client:
        blobs = client.get_container_client(container).list_blobs(name_starts_with=prefix)
        return sorted(b.name for b in blobs)


@pytest.fixture
def via(azurite: Azurite, az_container: StoreTarget) -> tuple[StoreTarget, FaultProxy]:
    """The test container reached through a recording, fault-injecting proxy."""
    with FaultProxy(azurite.endpoint_url, seed=5, operation_of=azure_operation) as proxy:
        target = StoreTarget(
            root=az_container.root,
            storage_options=azurite.storage_options(proxy.endpoint_url),
            bucket=az_container.bucket,
        )
        yield target, proxy


def test_a_manager_saves_asynchronously_loads_and_keeps_the_last_two(
    az_container: StoreTarget, azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    """The training-loop facade on ``az://``: async saves committed create-only
    (no "not atomic" warning), retention deleting old steps, a restarted manager
    resuming from the newest step and loading it bit-exact."""
    caplog.set_level(logging.WARNING, logger="objckpt")
    root = az_container.url("run")
    options = az_container.storage_options
    upload = UploadOptions(part_size=5 * MiB)
    with CheckpointManager(
        root, storage_options=options, retention=RetentionPolicy(keep_last=2), upload=upload
    ) as mgr:
        for step in (10, 20, 30):
            handle = mgr.save(step, _state(step))
            handle.result(timeout=120)
        mgr.wait_until_finished()
        mgr.check_for_errors()
        assert mgr.all_steps() == [20, 30]
    assert not [r for r in caplog.records if NOT_ATOMIC in r.getMessage()]
    steps = {n.split("/")[2] for n in _names(azurite, az_container.bucket, "t/run/")}
    assert steps == {step_name(20), step_name(30)}, steps

    with CheckpointManager(root, storage_options=options) as mgr:
        assert mgr.latest_step() == 30
        got = empty_like_state(_state(0))
        mgr.load(got)
    assert_state_equal(got, _state(30))
    report = verify_checkpoint(Location.parse(f"{root}/{step_name(30)}", options))
    assert report.ok, report.failures


def test_a_second_create_is_checkpoint_exists(az_container: StoreTarget) -> None:
    """Azure answers the second create-only Put Blob 409 ``BlobAlreadyExists``:
    ``CheckpointExistsError`` naming the winner, whose manifest is unchanged."""
    from torch.distributed.checkpoint.metadata import Metadata

    url = az_container.url("taken")
    location = Location.parse(url, az_container.storage_options)
    empty = Metadata(state_dict_metadata={})
    winner, loser = open_store(location), open_store(location)
    assert isinstance(winner, AzureStore)
    try:
        commit_checkpoint(winner, empty, [], attempt="a" * 16, world_size=1, overwrite=False)
        before = winner.read(MANIFEST_KEY)
        with pytest.raises(CheckpointExistsError, match=f"by attempt {'a' * 16}"):
            commit_checkpoint(loser, empty, [], attempt="b" * 16, world_size=1, overwrite=False)
        assert winner.read(MANIFEST_KEY) == before
    finally:
        winner.close()
        loser.close()


@pytest.mark.parametrize("scheme", ["az", "abfs"])
def test_a_second_save_to_a_committed_url_is_refused(
    az_container: StoreTarget, scheme: str
) -> None:
    """Either scheme is the Azure family; the second ``dcp.save`` to a committed URL
    is ``CheckpointExistsError`` and the first checkpoint loads unchanged."""
    url = az_container.url("twice").replace("az://", f"{scheme}://", 1)
    assert store_family(Location.parse(url).protocol) is AzureStore
    save(_state(1), url, az_container)
    with pytest.raises(BaseException) as info:
        save(_state(2), url, az_container)
    assert isinstance(carried(info.value), CheckpointExistsError), repr(carried(info.value))
    got = empty_like_state(_state(0))
    load(got, url, az_container)
    assert_state_equal(got, _state(1))


def test_a_commit_whose_answer_was_lost_is_settled_by_reading_it_back(
    via: tuple[StoreTarget, FaultProxy], az_container: StoreTarget
) -> None:
    """The manifest's Put Blob reaches Azurite, then its answer is lost (a reset).
    objckpt's retry layer sends it again and meets its own blob (409 ``BlobAlreadyExists``, or
    another lost answer): the read-back finds this save's bytes, so it commits."""
    target, proxy = via
    proxy.add(
        Rule("PutBlob", key_contains=MANIFEST_KEY, action="reset", before_upstream=False, times=1)
    )
    url = target.url("lost")
    save(_state(4), url, target)
    assert proxy.count("PutBlob", faulted=True) == 1
    assert len([p for p in proxy.paths("PutBlob") if MANIFEST_KEY in p]) >= 2  # it was resent
    got = empty_like_state(_state(0))
    load(got, url, az_container)
    assert_state_equal(got, _state(4))
    report = verify_checkpoint(Location.parse(url, az_container.storage_options))
    assert report.ok, report.failures


def test_a_large_object_is_staged_blocks_and_visible_only_once_committed(
    via: tuple[StoreTarget, FaultProxy], azurite: Azurite
) -> None:
    """Above two parts an object goes up as blocks, all four in flight at once, and
    becomes a blob with one Put Block List. With every block staged
    on the store (their answers held), there is no blob of that name, not a partial
    one: only uncommitted blocks."""
    target, proxy = via
    proxy.add(Rule("PutBlock", action="hold", before_upstream=False, stall=120))
    location = Location.parse(target.url("big"), target.storage_options)
    store = open_store(location, UploadOptions(part_size=5 * MiB, max_parts_in_flight=4))
    data = torch.randn(5 * MiB, generator=torch.Generator().manual_seed(9)).numpy().tobytes()
    try:
        upload = store.begin("big.bin", len(data))
        assert isinstance(upload, BlockUpload)
        for at in range(0, len(data), MiB):
            upload.write(data[at : at + MiB])
        done = upload.close()
        proxy.wait_for("PutBlock", count=4)  # 20 MiB in 5 MiB parts
        proxy.wait_idle()  # each has landed; its answer is held
        assert proxy.peak_open("PutBlock") == 4
        assert _names(azurite, target.bucket, "t/big/") == []
        with azurite.blob_service_client() as client:
            blob = client.get_blob_client(target.bucket, "t/big/big.bin")
            assert len(blob.get_block_list("uncommitted")[1]) == 4
        proxy.release()
        done.result(timeout=60)
    finally:
        proxy.release()
        store.close()
    assert proxy.count("PutBlockList") == 1 and proxy.count("PutBlob") == 0
    assert _names(azurite, target.bucket, "t/big/") == ["t/big/big.bin"]
    with azurite.blob_service_client() as client:
        blob = client.get_blob_client(target.bucket, "t/big/big.bin")
        assert blob.download_blob().readall() == data


def _committed(azurite: Azurite, container: str, name: str) -> tuple[list[int], bytes]:
    """A blob's committed block sizes, in order, and its bytes."""
    with azurite.blob_service_client() as client:
        blob = client.get_blob_client(container, name)
        return [b.size for b in blob.get_block_list("committed")[0]], blob.download_blob().readall()


def test_a_large_object_that_wrote_nothing_is_an_empty_blob(
    az_container: StoreTarget, azurite: Azurite
) -> None:
    """An upload begun for a large object (staged blocks) that is closed with nothing
    written commits one empty block: an empty blob, not an error."""
    location = Location.parse(az_container.url("empty"), az_container.storage_options)
    store = open_store(location, UploadOptions(part_size=5 * MiB))
    try:
        upload = store.begin("e.bin", 100 * MiB)
        assert isinstance(upload, BlockUpload)
        upload.close().result(timeout=120)
        assert upload.crc32c == "00000000"
    finally:
        store.close()
    assert _committed(azurite, az_container.bucket, "t/empty/e.bin")[1] == b""


@pytest.mark.parametrize(("tail", "blocks"), [(4_731, 3), (5 * MiB, 4)], ids=["short", "long"])
def test_a_short_tail_is_no_block_of_its_own(
    az_container: StoreTarget, azurite: Azurite, tail: int, blocks: int
) -> None:
    """A payload object a few KiB past a multiple of the part size (its tensors'
    frames) made a block of those few KiB: one more Put Block (#47). Its blocks now
    grow a little so as many cover it; a tail of 5 MiB or more is still a block."""
    location = Location.parse(az_container.url("tail"), az_container.storage_options)
    options = UploadOptions(part_size=5 * MiB)
    store = open_store(location, options)
    data = os.urandom(3 * 5 * MiB + tail)
    try:
        upload = store.begin("t.bin", len(data))
        assert isinstance(upload, BlockUpload)
        for at in range(0, len(data), 3 * MiB):
            upload.write(data[at : at + 3 * MiB])
        upload.close().result(timeout=120)
    finally:
        store.close()
    sizes, stored = _committed(azurite, az_container.bucket, "t/tail/t.bin")
    part = options.part_size_for(len(data))
    assert sizes == [part] * (blocks - 1) + [len(data) - part * (blocks - 1)]
    assert stored == data


def test_blocks_stay_within_azures_largest_block(
    az_container: StoreTarget, azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``part_size`` may be up to S3's 5 GiB part, but Azure's Put Block takes at most
    4,000 MiB: a store's blocks are cut at the smaller (the limit is lowered here so
    that a test can reach it)."""
    monkeypatch.setattr(azure_writers, "MAX_BLOCK", 6 * MiB)
    location = Location.parse(az_container.url("cap"), az_container.storage_options)
    store = open_store(location, UploadOptions(part_size=8 * MiB))
    data = os.urandom(20 * MiB)
    try:
        upload = store.begin("c.bin", len(data))
        assert isinstance(upload, BlockUpload)
        upload.write(data)
        upload.close().result(timeout=120)
    finally:
        store.close()
    sizes, stored = _committed(azurite, az_container.bucket, "t/cap/c.bin")
    assert sizes == [6 * MiB] * 3 + [2 * MiB]
    assert stored == data


def test_the_cli_demo_ls_verify_and_gc_on_az(
    az_container: StoreTarget, azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``objckpt demo --url az://…`` with the account from the standard environment
    variable (as adlfs reads it), then the store commands on what it saved."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    root = az_container.url("demo")
    runner = CliRunner()
    out = runner.invoke(
        main, ["demo", "--url", root, "--steps", "40", "--every", "20", "--width", "16", "--json"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert doc["weights_match"] is True and doc["restored_step"] == 40, doc

    out = runner.invoke(main, ["ls", root, "--json"])
    assert out.exit_code == 0, out.output
    assert "40" in out.output
    out = runner.invoke(main, ["verify", f"{root}/{step_name(40)}"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["gc", root, "--grace", "0"])
    assert out.exit_code == 0, out.output


def test_a_missing_container_and_a_wrong_key_are_named_before_anything_is_staged(
    azurite: Azurite, az_container: StoreTarget
) -> None:
    """Azure's answers translated at the boundary: no container is
    ``BucketNotFoundError`` naming it; a key the account refuses (403
    ``AuthorizationFailure`` from Azurite, ``AuthenticationFailed`` from Azure) is
    ``AccessDeniedError``."""
    with pytest.raises(BaseException) as info:
        save(_state(1), "az://no-such-container/x", az_container)
    err = carried(info.value)
    assert isinstance(err, BucketNotFoundError) and "no-such-container" in str(err), repr(err)

    wrong = {"connection_string": azurite.connection_string().replace(AZURITE_KEY, "A" * 86 + "==")}
    target = StoreTarget(root=az_container.root, storage_options=wrong, bucket=az_container.bucket)
    with pytest.raises(BaseException) as info:
        save(_state(1), target.url("x"), target)
    assert isinstance(carried(info.value), AccessDeniedError), repr(carried(info.value))


def test_a_loads_range_is_written_into_its_sink_as_it_downloads(
    az_container: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's range is written into the reader's memory as azure-storage-blob
    downloads it (``readinto``: chunk after chunk, across the sink's buffers), never
    first joined into one answer by adlfs's ``cat_file`` and copied in after (#47).
    Chunks are made 1 MiB so that a 5 MiB range takes several."""
    built = RetryingAzureBlobFileSystem.client_options

    def small_chunks(self: RetryingAzureBlobFileSystem) -> dict:
        return {**built(self), "max_single_get_size": MiB, "max_chunk_get_size": MiB}

    monkeypatch.setattr(RetryingAzureBlobFileSystem, "client_options", small_chunks)
    # A client of its own (the process caches one per set of options) that the
    # small chunks are built into.
    options = {**az_container.storage_options, "skip_instance_cache": True}
    store = open_store(Location.parse(az_container.url("into"), options))
    data = os.urandom(5 * MiB + 3)
    try:
        assert store._fs.service_client._config.max_chunk_get_size == MiB
        store.put("r.bin", data)

        def joined(*args: object, **kwargs: object) -> bytes:
            raise AssertionError("a range was read whole through adlfs's cat_file")

        monkeypatch.setattr(AzureBlobFileSystem, "_cat_file", joined)
        first, second = bytearray(2 * MiB + 1), bytearray(3 * MiB)
        past, guard = bytearray(MiB), bytearray(8)
        got = store.read_ranges_into(
            ["r.bin", "r.bin"],
            [2, 4 * MiB],
            [len(data), 6 * MiB],
            [
                SpanSink([memoryview(first), memoryview(second)]),
                SpanSink([memoryview(past), memoryview(guard)]).window(0, MiB),
            ],
        )
    finally:
        store.close()
    assert got == [len(data) - 2, MiB + 3]
    assert bytes(first + second)[: len(data) - 2] == data[2:]
    assert bytes(past) == data[4 * MiB : 5 * MiB] and not any(guard)


@pytest.mark.parametrize("check", ["x-ms-content-crc64", "content-md5"])
@pytest.mark.parametrize(
    ("operation", "size"), [("PutBlock", 12 * MiB), ("PutBlob", MiB)], ids=["block", "blob"]
)
def test_a_body_damaged_on_the_way_is_refused_by_the_service_and_sent_again(
    via: tuple[StoreTarget, FaultProxy],
    azurite: Azurite,
    monkeypatch: pytest.MonkeyPatch,
    operation: str,
    size: int,
    check: str,
) -> None:
    """Every Put Block and Put Blob carries its body's CRC64 (``x-ms-content-crc64``;
    a Content-MD5 where anycrc is missing), which the service checks: a body damaged on
    the way is refused (400 ``Crc64Mismatch``, ``Md5Mismatch``), sent again as a
    transient failure, and the blob holds the bytes sent. Before, a Put Blob carried
    no checksum (Azurite kept the damaged bytes) and a refused block failed the
    upload."""
    if check == "x-ms-content-crc64":
        pytest.importorskip("anycrc", reason="the azure extra's CRC64 (Python 3.11 and later)")
    target, proxy = via
    proxy.add(Rule(operation, action="corrupt", nth=1))
    location = Location.parse(target.url("damaged"), target.storage_options)
    store = open_store(location, UploadOptions(part_size=5 * MiB))
    if check == "content-md5":
        monkeypatch.setattr(store._fs, "_crc64", None)  # as without anycrc
    data = os.urandom(size)
    try:
        upload = store.begin("d.bin", len(data))
        assert isinstance(upload, BlockUpload) is (operation == "PutBlock")
        upload.write(data)
        upload.close().result(timeout=120)
    finally:
        store.close()
    sizes, stored = _committed(azurite, target.bucket, "t/damaged/d.bin")
    assert stored == data
    # The damaged one, and each block (or the blob) once as sent: the damaged one again.
    assert proxy.count(operation, faulted=True) == 1
    assert proxy.count(operation, faulted=False) == max(len(sizes), 1)
    other = ({"x-ms-content-crc64", "content-md5"} - {check}).pop()
    sent = [dict(s.amz) for s in proxy.seen if s.operation == operation]
    assert sent and all(check in h and other not in h for h in sent)


def test_the_crc64_sent_is_microsofts(azurite: Azurite) -> None:
    """The CRC64 objckpt sends (anycrc's CRC-64/NVME) is the one Microsoft's own
    implementation computes for azure-storage-blob (and Azurite checks it: above), on
    lengths around its 8- and 64-byte strides."""
    pytest.importorskip("anycrc", reason="the azure extra's CRC64 (Python 3.11 and later)")
    from azure.storage.extensions.checksums import crc64

    fs = RetryingAzureBlobFileSystem(**azurite.storage_options(), skip_instance_cache=True)
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 4096, MiB, 2 * MiB + 3):  # a MiB per call
        data = os.urandom(n)
        sent = fs.transit_check(data)["transactional_content_crc64"]
        assert sent == crc64.compute(data, 0).to_bytes(8, "little"), n
    assert fs.transit_check(b"x", whole=False) == {"validate_content": True}


def test_a_commit_damaged_on_the_way_is_refused_and_sent_again(
    via: tuple[StoreTarget, FaultProxy],
) -> None:
    """The manifest, the commit point, is written by a create-only Put Blob through
    adlfs's synchronous ``pipe_file``; it carries its checksum as every other body
    does, so a manifest damaged on the way is refused and written again, never kept."""
    target, proxy = via
    proxy.add(Rule("PutBlob", key_contains=MANIFEST_KEY, action="corrupt", nth=1))
    state = _state(3)
    url = target.url("commit-damaged")
    save(state, url, target)
    assert proxy.count("PutBlob", faulted=True) == 1
    got = empty_like_state(state)
    load(got, url, target)
    assert_state_equal(got, state)


def test_a_body_damaged_on_every_try_fails_after_three_saying_why(
    via: tuple[StoreTarget, FaultProxy],
) -> None:
    """Damage on the way is rare; a body refused for its checksum three times means
    the path damages every request (on Azure the bytes checksummed are the bytes sent):
    the upload fails then, naming the object and the cause, not after
    ``give_up_after``."""
    target, proxy = via
    proxy.add(Rule("PutBlob", action="corrupt"))
    location = Location.parse(target.url("always-damaged"), target.storage_options)
    store = open_store(location, UploadOptions(part_size=5 * MiB))
    try:
        upload = store.begin("d.bin", MiB)
        upload.write(os.urandom(MiB))
        with pytest.raises(StoreRefusedError, match="refused the body 3 times") as caught:
            upload.close().result(timeout=120)
    finally:
        store.close()
    assert "d.bin" in str(caught.value) and "damages every request" in str(caught.value)
    assert proxy.count("PutBlob") == 3
