"""``.metadata`` only up to a world size, and on demand after (#46): the option, the
manifest's record of it, both commit strategies, overwrites and copies over a step
that had one, ``objckpt verify``, :func:`objckpt.write_stock_metadata` and its CLI."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from commit_strategies import STRATEGIES, commit_via, one_value_save

from objckpt import write_stock_metadata
from objckpt.cli.app import main
from objckpt.errors import CheckpointExistsError, ConfigurationError, ManifestError, UploadError
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.options import UploadOptions
from objckpt.writers import open_store
from objckpt.writers.base import ObjectStore
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

    def overwritten_meanwhile(on: Any, manifest: Manifest) -> bytes:
        blob = built(on, manifest)
        _save("in-thread", store, "2" * 16, b"newer", NONE, overwrite=True)
        return blob

    monkeypatch.setattr(stock, "_build", overwritten_meanwhile)
    with pytest.raises(CheckpointExistsError, match=r"overwritten while its \.metadata was built"):
        write_stock_metadata(store.location)
    assert not store.exists(".metadata")


def test_the_cli_writes_it_and_says_where(tmp_path: Path) -> None:
    """``objckpt stock-metadata URL`` writes it and reports its URL, size and CRC32C
    (``--json``); a URL with no committed step fails naming it."""
    store = _store(tmp_path, "step-1")
    _save("in-thread", store, "1" * 16, b"value", NONE)
    result = CliRunner().invoke(main, ["stock-metadata", "--json", store.location.url])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    blob = store.read(".metadata")
    assert doc["url"] == store.location.url_of(".metadata") and doc["size"] == len(blob)
    missing = f"file://{tmp_path}/never"
    result = CliRunner().invoke(main, ["stock-metadata", missing])
    assert result.exit_code != 0 and "never" in result.output
