"""Bucket contents are untrusted input: crafted checkpoints against the reader.

Each case takes a real checkpoint objckpt (or stock DCP) wrote, edits what an
attacker with write access to the bucket could edit (re-encoding so the manifest's
recorded sizes and CRC32Cs match, as an attacker would), and loads it in a child
process under ``RLIMIT_AS`` = 4 GiB with a time limit, against moto through the
recording proxy (or on ``file://``). Every case must end in an objckpt error that
names the crafted object, after a handful of requests, with nothing outside the
checkpoint read: never a ``MemoryError``, ``RecursionError`` or ``OverflowError``,
never tens of thousands of ranged GETs.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from crafted import (
    CRAFTED,
    MIB,
    SECRET,
    N,
    _child,
    _chunk_count,
    _Ckpt,
    _deep_manifest,
    _index_claims_a_tib,
    _outside,
    _saved,
    _size_as_runs,
    _size_text,
)
from helpers import quiet
from torch.distributed.checkpoint.filesystem import _StorageInfo

from objckpt import CheckpointManager
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_entropy_dir,
    is_objckpt_object,
    is_objckpt_payload,
)
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import BUCKET, StoreTarget


@pytest.mark.parametrize("craft", CRAFTED, ids=lambda c: c.__name__.strip("_"))
def test_a_crafted_checkpoint_is_refused_naming_the_object_after_a_few_requests(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, craft: Callable[[_Ckpt], str]
) -> None:
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    ck = _saved(target, "run/ck")
    culprit = craft(ck)
    s3_proxy.clear()
    got = _child(ck.url, target.storage_options)
    assert got.get("error") == "objckpt.errors.ManifestError", got
    assert culprit in got["message"], got
    # The manifest, at most the index object, and nothing else: no payload GET.
    assert len(s3_proxy.seen) <= 3, [(s.operation, s.path) for s in s3_proxy.seen]
    assert not [p for p in s3_proxy.paths("GetObject") if p.endswith(".distcp")]
    assert _outside(s3_proxy, f"/{BUCKET}/t/run/ck/") == []


@pytest.mark.parametrize(
    ("craft", "bound"),
    [
        (
            _index_claims_a_tib,
            r"'\w+' lies at bytes \d+-\d+ of '__0_0\.\w+\.distcp', which holds \d+",
        ),
        (_size_as_runs, r"'w': size must be a list"),
    ],
    ids=["index-lengths-2-40", "size-as-runs"],
)
def test_verify_and_info_refuse_what_a_load_refuses(
    s3_bucket: StoreTarget, cli: Any, craft: Callable[[_Ckpt], str], bound: str
) -> None:
    """Crafted with every recorded size and CRC32C recomputed, so each object matches
    its manifest entry: ``verify`` still fails (exit 1) naming the object and the bound
    a load refuses it by, and ``info`` refuses it too (exit 4). Unfixed: "3 objects
    checked, ok" and a summary."""
    ck = _saved(s3_bucket, "run/ck")
    culprit = craft(ck)
    verified = cli("verify", ck.url)
    assert verified.exit_code == 1, verified.output
    line = next(ln for ln in verified.stdout.splitlines() if ln.startswith("FAIL"))
    assert line.startswith(f"FAIL {culprit}: a load refuses it: "), line
    assert re.search(bound, line), line
    assert verified.stdout.rstrip().endswith("3 objects checked, 1 refused by a load's checks")
    doc = json.loads(cli("verify", ck.url, "--json").stdout)
    assert not doc["ok"] and [f["url"] for f in doc["failures"]] == [culprit], doc
    info = cli("info", ck.url)
    assert info.exit_code == 4, info.output
    assert culprit in info.output and re.search(bound, info.output), info.output


def test_an_item_of_a_tib_on_file_is_refused(tmp_path: Path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    ck = _saved(target, "ck")
    culprit = _index_claims_a_tib(ck)
    got = _child(ck.url, {})
    assert got.get("error") == "objckpt.errors.ManifestError", got
    assert culprit in got["message"], got


# -- a stock .metadata whose payload is outside the checkpoint -----------------------------
def _stock(directory: Path, value: float) -> None:
    with quiet():
        dcp.save(
            {"w": torch.full((N,), value), "step": 3},
            storage_writer=dcp.FileSystemWriter(str(directory)),
            no_dist=True,
        )


def _escape(metadata_file: Path, to: str) -> None:
    """Point every item of a stock ``.metadata`` at ``to`` + its own file name."""
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.storage_data = {
        index: _StorageInfo(to + info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
    }
    metadata_file.write_bytes(pickle.dumps(metadata))


def test_a_stock_metadata_pointing_outside_is_refused_on_file(tmp_path: Path) -> None:
    _stock(tmp_path / "secret", SECRET)
    _stock(tmp_path / "run" / "ck", 1.0)
    _escape(tmp_path / "run" / "ck" / METADATA_KEY, "../../secret/")
    got = _child(f"file://{tmp_path}/run/ck", {})
    # Before: the reader loaded the outside checkpoint's values.
    assert "loaded" not in got, got
    assert got["error"] == "objckpt.errors.ManifestError", got
    assert f"file://{tmp_path}/run/ck/{METADATA_KEY}" in got["message"], got
    assert "../../secret/" in got["message"], got


def test_a_stock_metadata_pointing_outside_is_refused_on_s3(
    tmp_path: Path, s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    _stock(tmp_path / "secret", SECRET)
    _stock(tmp_path / "ck", 1.0)
    _escape(tmp_path / "ck" / METADATA_KEY, "../../secret/")
    fs = fsspec.filesystem("s3", **s3_bucket.storage_options, skip_instance_cache=True)
    for name in ("secret", "ck"):
        for f in (tmp_path / name).iterdir():
            dest = f"{BUCKET}/t/{'secret' if name == 'secret' else 'run/ck'}/{f.name}"
            fs.pipe_file(dest, f.read_bytes())
    s3_proxy.clear()
    got = _child(s3_bucket.url("run/ck"), s3_proxy.storage_options())
    assert "loaded" not in got, got
    assert got["error"] == "objckpt.errors.ManifestError", got
    assert f"{s3_bucket.url('run/ck')}/{METADATA_KEY}" in got["message"], got
    # Before: GET .../run/ck/../../secret/__0_0.distcp
    assert _outside(s3_proxy, f"/{BUCKET}/t/run/ck/") == []
    assert not [p for p in s3_proxy.paths("GetObject") if "secret" in p]
    assert len(s3_proxy.seen) <= 4, [(s.operation, s.path) for s in s3_proxy.seen]


# -- size caps -----------------------------------------------------------------------------
def _padded(ck: _Ckpt, size: int) -> bytes:
    """The manifest, still valid, grown to ``size`` bytes with user metadata."""
    data = json.dumps(ck.manifest, separators=(",", ":")).encode()
    pad = size - len(data) - len(b'"x":[]') - 1
    return data.replace(b'"user":{}', b'"user":{"x":[' + b"0," * (pad // 2) + b"0]}")


def test_a_manifest_over_the_cap_is_refused_without_fetching_it(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    ck = _saved(target, "run/ck")
    ck.put_manifest(_padded(ck, 3 * MIB))
    s3_proxy.clear()
    got = _child(ck.url, target.storage_options, read={"max_metadata_bytes": MIB})
    assert got.get("error") == "objckpt.errors.ManifestError", got
    assert ck.location.url_of(MANIFEST_KEY) in got["message"], got
    assert "max_metadata_bytes" in got["message"] and str(MIB) in got["message"], got
    assert s3_proxy.received_bytes("GetObject") <= MIB + 1
    assert len(s3_proxy.seen) == 1, [(s.operation, s.path) for s in s3_proxy.seen]


def test_an_index_recorded_over_the_cap_is_never_fetched(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    ck = _saved(target, "run/ck")
    ck.put_index(b" " * (2 * MIB - 2) + ck.get(ck.index_key))
    s3_proxy.clear()
    got = _child(ck.url, target.storage_options, read={"max_metadata_bytes": MIB})
    assert got.get("error") == "objckpt.errors.ManifestError", got
    assert ck.location.url_of(ck.index_key) in got["message"], got
    assert s3_proxy.paths("GetObject") == [f"/{BUCKET}/t/run/ck/{MANIFEST_KEY}"]


def test_a_500_mb_manifest_on_file_is_refused_by_the_default_cap(tmp_path: Path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    ck = _saved(target, "ck")
    data = json.dumps(ck.manifest, separators=(",", ":")).encode()
    head, tail = data.split(b'"user":{}')
    path = Path(ck.location.key_path(MANIFEST_KEY))
    with open(path, "wb") as f:  # valid JSON of 500 MB, written in pieces
        f.write(head + b'"user":{"x":[')
        for _ in range(250):
            f.write(b"0," * MIB)
        f.write(b"0]}" + tail)
    assert path.stat().st_size > 500 * MIB
    got = _child(ck.url, {})
    assert got.get("error") == "objckpt.errors.ManifestError", got
    assert ck.location.url_of(MANIFEST_KEY) in got["message"], got
    assert "max_metadata_bytes" in got["message"], got


# -- a refused primary falls back to the backup, as a missing one does ---------------------
@pytest.mark.parametrize("craft", [_deep_manifest, _chunk_count, _size_text(b"1e400")])
def test_a_refused_primary_falls_back_to_the_backup(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, craft: Callable[[_Ckpt], str]
) -> None:
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    root, backup = target.url("main"), target.url("backup")
    with CheckpointManager(root, storage_options=target.storage_options, backups=[backup]) as m:
        m.save(1, {"w": torch.arange(N, dtype=torch.float32) + 1, "step": 1})
        m.wait_until_finished()
    craft(_Ckpt(f"{root}/step-0000000001", target.storage_options))
    got = _child(root, target.storage_options, backups=[backup])
    assert got == {"loaded": [1.0, 2.0, 3.0, 4.0], "step": 1}, got


def test_layout_names_with_a_final_newline_are_not_objckpt_names() -> None:
    name = "__0_0.0123456789abcdef.distcp"
    assert is_objckpt_payload(name) and is_objckpt_object(name) and is_entropy_dir("3f")
    assert not is_objckpt_payload(name + "\n")
    assert not is_objckpt_object(name + "\n")
    assert not is_objckpt_object("__index_0.0123456789abcdef.json\n")
    assert not is_objckpt_object(name + ".objckpt-piece-0-00001\n")
    assert not is_entropy_dir("3f\n")
