"""``.metadata`` only up to a world size, and on demand after (#46): the option, the
manifest's record of it, both commit strategies, overwrites and copies over a step
that had one, ``objckpt verify``, :func:`objckpt.write_stock_metadata` and its CLI."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from commit_strategies import STRATEGIES, commit_via, one_value_save

from objckpt import ObjectStoreWriter, write_stock_metadata
from objckpt.cli.app import main
from objckpt.errors import CheckpointExistsError, ConfigurationError, ManifestError, UploadError
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.options import ReadOptions, UploadOptions
from objckpt.writers import open_store
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.location import Location

NONE = UploadOptions(stock_metadata_max_ranks=0)


def _store(tmp_path: Path, where: str) -> ObjectStore:
    return open_store(Location.parse(f"file://{tmp_path}/{where}"), UploadOptions())


def _save(
    strategy: str,
    store: ObjectStore,
    attempt: str,
    value: bytes,
    upload: UploadOptions | None = None,
    overwrite: bool = False,
) -> Manifest:
    metadata, results = one_value_save(store, attempt, value)
    return commit_via(
        strategy,
        store,
        metadata,
        results,
        attempt=attempt,
        world_size=1,
        overwrite=overwrite,
        upload=upload,
    )


def test_the_world_size_limit_decides_which_saves_write_metadata() -> None:
    """Up to ``stock_metadata_max_ranks`` ranks a save writes ``.metadata``, above it
    none; None: every save; 0: none. A bad value names the option."""
    assert UploadOptions().writes_stock_metadata(2048)
    assert not UploadOptions().writes_stock_metadata(2049)
    assert UploadOptions(stock_metadata_max_ranks=None).writes_stock_metadata(8192)
    assert not NONE.writes_stock_metadata(1)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigurationError, match="stock_metadata_max_ranks"):
            UploadOptions(stock_metadata_max_ranks=bad)  # type: ignore[arg-type]


def test_a_manifest_records_a_save_that_wrote_no_metadata() -> None:
    """``"stock_metadata": false`` round-trips; absent means written (every manifest
    before it); anything but a bool, or false beside a named ``.metadata``, is refused."""
    base = Manifest("a" * 16, "now", 1, "v", "t", (), {}, stock_metadata=False)
    doc = json.loads(base.to_json_bytes())
    assert doc["stock_metadata"] is False
    assert not Manifest.from_json_bytes(base.to_json_bytes(), url="u").stock_metadata
    del doc["stock_metadata"]
    assert Manifest.from_json_bytes(json.dumps(doc).encode(), url="u").stock_metadata
    for value in ("no", 0, None):
        doc["stock_metadata"] = value
        with pytest.raises(ManifestError, match="stock_metadata must be true or false"):
            Manifest.from_json_bytes(json.dumps(doc).encode(), url="u")
    doc["stock_metadata"] = False
    doc["objects"] = [{"key": ".metadata", "size": 0, "crc32c": "00000000"}]
    with pytest.raises(ManifestError, match=r"names \.metadata and says its save wrote none"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), url="u")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_save_above_the_limit_writes_none_and_drops_the_one_it_replaces(
    tmp_path: Path, strategy: str
) -> None:
    """A save of more ranks than the limit writes no ``.metadata`` and its manifest
    says so; one that overwrites a step that had one deletes it (left, a stock reader
    would load the replaced checkpoint at this URL), and then the replaced payload.
    ``objckpt verify`` owes it none; one written on demand names the attempt."""
    store = _store(tmp_path, "step-1")
    first = _save(strategy, store, "1" * 16, b"first")
    assert first.stock_metadata and store.exists(".metadata")
    second = _save(strategy, store, "2" * 16, b"second", NONE, overwrite=True)
    assert not second.stock_metadata and read_manifest(store).attempt == "2" * 16
    assert not store.exists(".metadata")  # unfixed: the first save's stays
    assert not store.exists("__0_0.1111111111111111.distcp")
    assert verify_checkpoint(store.location).ok
    entry = write_stock_metadata(store.location)
    assert entry == ObjectEntry(".metadata", entry.size, entry.crc32c) and entry.size > 0
    assert pickle.loads(store.read(".metadata")).storage_meta.save_id == "2" * 16
    assert verify_checkpoint(store.location).ok
    assert write_stock_metadata(store.location) == entry  # there already: not rewritten


def test_a_save_within_the_limit_keeps_writing_metadata(tmp_path: Path) -> None:
    """The default writes it for a one-rank save, and ``write_stock_metadata`` on such a
    step returns the manifest's entry and writes nothing."""
    store = _store(tmp_path, "step-1")
    manifest = _save("in-thread", store, "1" * 16, b"value")
    named = manifest.object(".metadata")
    assert named is not None and manifest.stock_metadata
    before = store.read(".metadata")
    assert write_stock_metadata(store.location) == named
    assert store.read(".metadata") == before


def test_a_metadata_written_on_demand_is_the_one_a_save_writes(tmp_path: Path) -> None:
    """The same items, chunks, locations and ``StorageMeta`` as the save's own build
    (one step saved both ways to the same URL length)."""
    a, b = _store(tmp_path, "a/step-1"), _store(tmp_path, "b/step-1")
    _save("in-thread", a, "1" * 16, b"value")
    _save("in-thread", b, "1" * 16, b"value", NONE)
    write_stock_metadata(b.location)
    ours, theirs = pickle.loads(a.read(".metadata")), pickle.loads(b.read(".metadata"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert ours.storage_data == theirs.storage_data
    assert theirs.storage_meta.checkpoint_id == b.location.url


def test_verify_reports_another_attempt_s_metadata_and_write_replaces_it(tmp_path: Path) -> None:
    """A ``.metadata`` that names another attempt (a replaced checkpoint's, written by
    an objckpt before this one) is reported by verify, and replaced on demand."""
    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"value", NONE)
    store.put(".metadata", b"stale: 2222222222222222")
    (failure,) = verify_checkpoint(store.location).failures
    assert failure.key == ".metadata" and "another save's" in str(failure.problem)
    write_stock_metadata(store.location)
    assert verify_checkpoint(store.location).ok


def test_a_copy_of_a_step_without_metadata_drops_the_destination_s(tmp_path: Path) -> None:
    """``cp --overwrite`` of a step saved without ``.metadata`` over a step with one: the
    destination's is deleted, then the payload only it named; a copy of the step once
    one was written on demand carries it."""
    src, dst = _store(tmp_path, "src/step-1"), _store(tmp_path, "dst/step-1")
    _save("in-thread", src, "1" * 16, b"source", NONE)
    _save("in-thread", dst, "2" * 16, b"replaced")
    copy_checkpoint(src.location, dst.location, overwrite=True)
    assert read_manifest(dst).attempt == "1" * 16
    assert not dst.exists(".metadata")  # unfixed: the replaced step's stays
    assert not dst.exists("__0_0.2222222222222222.distcp")
    write_stock_metadata(src.location)
    again = _store(tmp_path, "again/step-1")
    copy_checkpoint(src.location, again.location)
    assert again.read(".metadata") == src.read(".metadata")
    assert verify_checkpoint(again.location).ok


def test_an_index_object_that_differs_from_the_manifest_gets_no_metadata(tmp_path: Path) -> None:
    """Index objects are checked against the manifest's size and CRC32C before anything
    is built: a changed one is named, and nothing is written."""
    store = _store(tmp_path, "step-1")
    manifest = _save("in-thread", store, "1" * 16, b"value", NONE)
    (index,) = [o.key for o in manifest.objects if o.key.startswith("__index_")]
    store.put(index, store.read(index).replace(b"1111", b"3333", 1))
    with pytest.raises(UploadError, match=rf"{index} holds .* its rank wrote"):
        write_stock_metadata(store.location)
    assert not store.exists(".metadata")


def test_a_step_overwritten_while_its_metadata_is_built_gets_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is read again before the PUT: another save that committed over the
    step meanwhile wins, and this ``.metadata`` (the replaced attempt's) is not written."""
    from objckpt.ops.convert import stock

    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"value", NONE)
    built = stock._build

    def overwritten_meanwhile(on: Any, manifest: Manifest, limit: int) -> bytes:
        blob = built(on, manifest, limit)
        _save("in-thread", store, "2" * 16, b"newer", NONE, overwrite=True)
        return blob

    monkeypatch.setattr(stock, "_build", overwritten_meanwhile)
    with pytest.raises(CheckpointExistsError, match=r"or removed while its \.metadata was built"):
        write_stock_metadata(store.location)
    assert not store.exists(".metadata")


def test_a_step_overwritten_just_before_the_put_is_reported_and_mended_by_a_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is read again after the PUT: a save that committed over the step
    between the last check and the PUT makes it fail naming the replaced attempt. What
    it wrote is left (by then it may be the new save's); ``objckpt verify`` reports it
    as another attempt's, and running it again replaces it."""
    from objckpt.ops.convert import stock

    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"value", NONE)
    checked = stock._overwritten
    calls: list[bool] = []

    def overwritten_after_the_check(on: Any, manifest: Manifest) -> bool:
        answer = checked(on, manifest)
        if not calls:  # the check before the PUT, then another save commits
            _save("in-thread", store, "2" * 16, b"newer", NONE, overwrite=True)
        calls.append(answer)
        return answer

    monkeypatch.setattr(stock, "_overwritten", overwritten_after_the_check)
    with pytest.raises(CheckpointExistsError, match="may name the replaced attempt 1111"):
        write_stock_metadata(store.location)
    assert calls == [False, True]  # unfixed (no check after the PUT): no error
    (failure,) = verify_checkpoint(store.location).failures
    assert failure.key == ".metadata" and "another save's" in str(failure.problem)
    monkeypatch.undo()
    write_stock_metadata(store.location)
    assert pickle.loads(store.read(".metadata")).storage_meta.save_id == "2" * 16
    assert verify_checkpoint(store.location).ok


def test_a_rank_of_a_save_without_metadata_reports_no_digest(tmp_path: Path) -> None:
    """``write_rank_index(stock=False)``: the rank computes no ``stock_digest`` (O(its
    items), for a template no save of that size keeps)."""
    from commit_strategies import planned

    from objckpt.format.commit import write_rank_index
    from objckpt.writers.accounting import RequestStats

    store = _store(tmp_path, "step-1")
    _, results = one_value_save(store, "1" * 16, b"value")
    with_digest, without = (
        write_rank_index(store, results[0], 0, "1" * 16, RequestStats, planned(results[0]), s)
        for s in (True, False)
    )
    assert with_digest.stock_digest is not None and without.stock_digest is None
    assert without.index == with_digest.index


def test_a_save_without_metadata_to_a_new_url_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4 looks before it deletes: on a URL with no ``.metadata`` there is no
    DELETE (none needs delete permission, or leaves a delete marker in a versioned
    bucket)."""
    store = _store(tmp_path, "step-1")
    deleted: list[str] = []
    real = type(store).delete

    def delete(self: ObjectStore, key: str) -> None:
        deleted.append(key)
        real(self, key)

    monkeypatch.setattr(type(store), "delete", delete)
    _save("in-thread", store, "1" * 16, b"value", NONE)
    assert deleted == []


def test_a_copy_whose_source_metadata_cannot_be_read_leaves_the_destination_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source ``.metadata`` that cannot be read is not copied, and the destination's
    is left as it is (a copy resumed onto itself may have written it): unlike one that
    is absent or another attempt's, which the destination loses."""
    from objckpt.errors import StoreError
    from objckpt.ops.maintain import verify

    src, dst = _store(tmp_path, "src/step-1"), _store(tmp_path, "dst/step-1")
    _save("in-thread", src, "1" * 16, b"source", NONE)
    write_stock_metadata(src.location)
    _save("in-thread", dst, "2" * 16, b"replaced")
    before = dst.read(".metadata")

    def unreadable(*args: Any, **kwargs: Any) -> None:
        raise StoreError("read refused")

    monkeypatch.setattr(verify, "unnamed_metadata_check", unreadable)
    copy_checkpoint(src.location, dst.location, overwrite=True)
    assert read_manifest(dst).attempt == "1" * 16
    assert dst.read(".metadata") == before  # with the first fix: deleted


def test_the_cli_writes_it_and_says_where(tmp_path: Path) -> None:
    """``objckpt stock-metadata URL`` writes it and reports its URL, size and CRC32C
    (``--json``); a URL with no checkpoint exits 3 naming it."""
    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"value", NONE)
    result = CliRunner().invoke(main, ["stock-metadata", "--json", store.location.url])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    blob = store.read(".metadata")
    assert doc == {
        "url": store.location.url_of(".metadata"),
        "size": len(blob),
        "crc32c": f"{crc32c_of(blob):08x}",
    }
    missing = f"file://{tmp_path}/never"
    result = CliRunner().invoke(main, ["stock-metadata", missing])
    assert result.exit_code == 3 and f"no checkpoint at {missing}" in result.output


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "opt": {"step": 3, "lr": torch.tensor(0.5)},
    }


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_dcp_save_without_metadata_gets_what_its_own_save_would_have_written(
    tmp_path: Path, compression: str | None
) -> None:
    """``dcp.save`` with ``ObjectStoreWriter`` (the in-thread commit): the same state
    saved with and without ``.metadata``; the one written on demand holds what the
    save's holds but for the attempt id and the URL (every item, chunk, location and
    compressed item's transforms; its pickle shares fewer strings), and torch's
    ``FileSystemReader`` loads it."""
    from torch.distributed.checkpoint import FileSystemReader

    a, b = f"file://{tmp_path}/a/step-1", f"file://{tmp_path}/b/step-1"
    state = _state()
    for url, limit in ((a, None), (b, 0)):
        upload = UploadOptions(compression=compression, stock_metadata_max_ranks=limit)
        dcp.save(state, storage_writer=ObjectStoreWriter(url, upload=upload), no_dist=True)
    ours, theirs = (open_store(Location.parse(u), UploadOptions()) for u in (a, b))
    assert not theirs.exists(".metadata") and not read_manifest(theirs).stock_metadata
    with pytest.raises(FileNotFoundError, match=r"\.metadata"):
        FileSystemReader(f"{tmp_path}/b/step-1").read_metadata()
    write_stock_metadata(b)
    attempts = [read_manifest(s).attempt.encode() for s in (ours, theirs)]
    want = pickle.loads(ours.read(".metadata").replace(*attempts).replace(b"/a/", b"/b/"))
    got_md = pickle.loads(theirs.read(".metadata"))
    for field in ("state_dict_metadata", "planner_data", "storage_data", "storage_meta"):
        assert getattr(got_md, field) == getattr(want, field), field
    assert got_md.version == want.version
    got = {"w": torch.zeros(64, 64), "b": torch.zeros(7, dtype=torch.bfloat16), "opt": {}}
    got["opt"] = {"step": 0, "lr": torch.tensor(0.0)}
    dcp.load(got, storage_reader=FileSystemReader(f"{tmp_path}/b/step-1"), no_dist=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert got["opt"]["step"] == 3 and torch.equal(got["opt"]["lr"], state["opt"]["lr"])


def test_a_step_that_reuses_another_s_items_gets_a_metadata_stock_readers_follow(
    tmp_path: Path,
) -> None:
    """A second step references the first's unchanged tensor (``../step-…/``): written
    on demand, its ``.metadata`` names it as a save's does, and ``FileSystemReader``
    (which resolves ``..``) loads the second step."""
    from torch.distributed.checkpoint import FileSystemReader

    state = {"frozen": torch.randn(256, 64), "trained": torch.zeros(8, 8), "n": 1}
    one, two = (f"file://{tmp_path}/run/step-000000000{n}" for n in (1, 2))
    dcp.save(state, storage_writer=ObjectStoreWriter(one, upload=NONE), no_dist=True)
    state["trained"] += 1
    writer = ObjectStoreWriter(two, upload=NONE, reuse_from=one)
    dcp.save(state, storage_writer=writer, no_dist=True)
    manifest = read_manifest(open_store(Location.parse(two), UploadOptions()))
    assert manifest.reused_bytes > 0 and not manifest.stock_metadata
    write_stock_metadata(two)
    got = {"frozen": torch.zeros(256, 64), "trained": torch.zeros(8, 8), "n": 0}
    dcp.load(got, storage_reader=FileSystemReader(two.removeprefix("file://")), no_dist=True)
    assert torch.equal(got["frozen"], state["frozen"]) and torch.equal(
        got["trained"], state["trained"]
    )
    assert got["n"] == 1


def test_a_save_over_a_stock_dcp_checkpoint_deletes_its_metadata(tmp_path: Path) -> None:
    """``overwrite=True`` onto a URL holding a stock DCP checkpoint (no manifest), by a
    save that writes no ``.metadata``: the stock one is deleted, so torch's reader is
    refused instead of loading the replaced checkpoint beside the new manifest."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    path = tmp_path / "step-1"
    dcp.save({"w": torch.zeros(3)}, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    assert (path / ".metadata").exists()
    writer = ObjectStoreWriter(f"file://{path}", upload=NONE, overwrite=True)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert not (path / ".metadata").exists()  # unfixed: the stock checkpoint's stays
    with pytest.raises(FileNotFoundError, match=r"\.metadata"):
        FileSystemReader(str(path)).read_metadata()


def test_a_helper_that_cannot_finish_step_4_leaves_rank_0_to_delete_the_replaced_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save through the helper that writes no ``.metadata``, whose helper did not
    finish step 4 (restarted, stopped at its bound): rank 0 deletes the ``.metadata``
    it replaces itself, and says so."""
    from objckpt.pipeline.coordinator import CommitHelper

    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"first")
    monkeypatch.setattr(CommitHelper, "publish", lambda *a, **k: False)
    with caplog.at_level(logging.WARNING):
        manifest = _save("helper", store, "2" * 16, b"second", NONE, overwrite=True)
    assert manifest.attempt == "2" * 16 and not manifest.stock_metadata
    assert not store.exists(".metadata")  # unfixed: the first save's stays
    assert "rank 0 deletes the .metadata it replaces itself" in caplog.text


def test_an_index_object_above_the_read_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is untrusted: an index object it records above
    ``ReadOptions.max_metadata_bytes`` is refused naming it and the option, unread."""
    store = _store(tmp_path, "step-1")
    manifest = _save("in-thread", store, "1" * 16, b"value", NONE)
    (index,) = [o for o in manifest.objects if o.key.startswith("__index_")]
    read: list[str] = []

    def spy(name: str) -> Any:
        real = getattr(type(store), name)

        def reading(self: ObjectStore, key: str, *args: Any) -> Any:
            read.append(key)
            return real(self, key, *args)

        return reading

    for name in ("read", "read_bounded"):
        monkeypatch.setattr(type(store), name, spy(name))
    with pytest.raises(ManifestError, match=rf"{index.key} is {index.size} bytes, more than "):
        write_stock_metadata(store.location, read=ReadOptions(max_metadata_bytes=index.size - 1))
    assert index.key not in read and "manifest.json" in read
    assert not store.exists(".metadata")
