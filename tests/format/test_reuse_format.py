"""The format side of reuse (#28): reference keys in manifests and index objects,
format version 3, the xxh3 column, and crafted references that escape the root."""

from __future__ import annotations

import json

import pytest
import torch
from test_format_index import ATTEMPT, _simulated

from objckpt.errors import ManifestError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_index, decode_metadata, encode_metadata
from objckpt.format.manifest import REFERENCES_VERSION, VERSION, Manifest, ObjectEntry
from objckpt.format.reused import BaseItem, item_digest

REF = "../step-0000000001/__0_0.6b0000000000beef.distcp"
ESCAPES = [
    "../../x",
    "../notastep/x",
    "../step-0000000001/../x",
    "../step-1/x",
    "..//x",
    "../step-0000000001\n/x",  # `$` matched before a trailing newline
    "../step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661/x",  # not ASCII
]


def _manifest(*keys: str) -> Manifest:
    return Manifest(
        attempt=ATTEMPT,
        created=Manifest.now(),
        world_size=1,
        objckpt_version="0.1.0",
        torch_version=torch.__version__,
        objects=tuple(ObjectEntry(k, 10, "0000abcd") for k in keys),
        metadata={"state_dict": {}, "storage": []},
    )


def test_a_manifest_with_references_is_format_3_and_counts_reused_bytes() -> None:
    plain = json.loads(_manifest("__0_0.x.distcp").to_json_bytes())
    assert plain["version"] == VERSION == 2 and "reused_bytes" not in plain
    data = _manifest("__0_0.x.distcp", REF).to_json_bytes()
    doc = json.loads(data)
    assert doc["version"] == REFERENCES_VERSION == 3
    assert doc["total_bytes"] == 20 and doc["reused_bytes"] == 10
    parsed = Manifest.from_json_bytes(data, url="s3://b/run/step-0000000002/manifest.json")
    assert parsed.reused_bytes == 10 and parsed.object(REF) is not None


def test_a_reference_in_a_format_2_manifest_or_a_wrong_reused_count_is_refused() -> None:
    doc = json.loads(_manifest("__0_0.x.distcp", REF).to_json_bytes())
    doc["version"] = 2
    with pytest.raises(ManifestError, match="references need format 3"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), url="u")
    doc["version"], doc["reused_bytes"] = 3, 11
    with pytest.raises(ManifestError, match="reused_bytes 11"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), url="u")


@pytest.mark.parametrize("key", ESCAPES)
def test_crafted_references_that_escape_are_refused_in_a_manifest(key: str) -> None:
    doc = json.loads(_manifest("__0_0.x.distcp", REF).to_json_bytes())
    doc["objects"][1]["key"] = key
    with pytest.raises(ManifestError, match="escapes the checkpoint") as info:
        Manifest.from_json_bytes(json.dumps(doc).encode(), url="s3://b/c/manifest.json")
    assert "s3://b/c/manifest.json" in str(info.value)


@pytest.mark.parametrize("key", ESCAPES)
def test_crafted_references_that_escape_are_refused_in_an_index(key: str) -> None:
    meta, items = _simulated(1)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    decoded, _ = decode_metadata(json.loads(json.dumps(doc)), url="u")
    bad = json.loads(shards[0].data)
    bad["keys"] = [key] * len(bad["keys"])
    with pytest.raises(ManifestError, match="escapes"):
        decode_index(json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i")
    bad["keys"] = [REF] * len(bad["keys"])  # a well-formed reference is a key like any
    found = decode_index(
        json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i"
    )
    assert {item.relative_path for item in found.values()} == {REF}


def test_a_step_directory_name_is_ascii_digits_and_nothing_after() -> None:
    from objckpt.format.steps import parse_step

    assert parse_step("step-0000000001") == 1
    assert parse_step("step-0000000001\n") is None
    assert parse_step("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661") is None


def test_the_index_carries_each_items_xxh3_and_refuses_a_damaged_column() -> None:
    meta, items = _simulated(1)
    digest = "0123456789abcdef0123456789abcdef"
    hashed = [{i: StoredItem(**{**vars(it), "xxh3": digest}) for i, it in items[0].items()}]
    doc, shards = encode_metadata(meta, hashed, ATTEMPT)
    decoded, _ = decode_metadata(json.loads(json.dumps(doc)), url="u")
    found = decode_index(shards[0].data, rank=0, attempt=ATTEMPT, metadata=decoded, url="i")
    assert found == hashed[0] and {it.xxh3 for it in found.values()} == {digest}
    bad = json.loads(shards[0].data)
    bad["xxh3"] = bad["xxh3"][:-1]
    with pytest.raises(ManifestError, match="xxh3 must be 32 hex digits"):
        decode_index(json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i")
    del bad["xxh3"]  # an index written before #28: loads, with no hashes
    found = decode_index(
        json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i"
    )
    assert all(it.xxh3 is None for it in found.values())


def test_an_item_matches_its_base_only_with_the_same_length_and_xxh3() -> None:
    length, digest = item_digest((b"head", memoryview(b"payload"), b"tail"))
    assert (length, digest) == item_digest((b"headpayloadtail",))
    base = BaseItem(REF, 0, length, "0000abcd", digest, 100, "0000abcd")
    assert base.matches(length, digest)
    assert not base.matches(length + 1, digest)
    assert not base.matches(length, item_digest((b"headpayloadtaiL",))[1])
