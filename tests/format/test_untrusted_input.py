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
import os
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import counting_state
from helpers import quiet, save
from torch.distributed.checkpoint.filesystem import _StorageInfo

from objckpt import CheckpointManager, Location
from objckpt.format import columns
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import BUCKET, StoreTarget
from objckpt.testing.servers import offline_env

TIB = 1 << 40
MIB = 1 << 20
N = 4096  # elements of the tensor every case saves
SECRET = 7.0  # the value of the tensor outside the checkpoint

# The load, in a process of its own: 4 GiB of address space (torch alone maps ~0.7),
# one JSON line out: the error objckpt raised (unwrapped from torch's), or what loaded.
_CHILD = textwrap.dedent(
    """
    import json, resource, sys, warnings
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    import torch, torch.distributed.checkpoint as dcp
    import objckpt
    warnings.filterwarnings("ignore")
    spec = json.loads(sys.argv[1])
    state = {"w": torch.zeros(spec["n"]), "step": 0}
    read = objckpt.ReadOptions(**spec["read"]) if spec["read"] else None
    try:
        if spec["backups"]:
            with objckpt.CheckpointManager(
                spec["url"], storage_options=spec["options"], backups=spec["backups"]
            ) as mgr:
                mgr.load(state, read=read)
        else:
            reader = objckpt.ObjectStoreReader(
                spec["url"], storage_options=spec["options"], read=read
            )
            dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as exc:
        failures = getattr(exc, "failures", None)
        if failures:  # torch's CheckpointException carries ours
            failure = next(iter(failures.values()))
            exc = failure[0] if isinstance(failure, tuple) else failure
        kind = type(exc)
        print(json.dumps({"error": kind.__module__ + "." + kind.__name__, "message": str(exc)}))
        sys.exit(0)
    print(json.dumps({"loaded": state["w"][:4].tolist(), "step": state["step"]}))
    """
)


def _child(
    url: str,
    options: dict[str, Any],
    *,
    read: dict[str, Any] | None = None,
    backups: list[str] | None = None,
    timeout: float = 60,
) -> dict[str, Any]:
    """Load ``url`` in a child process; what it printed (its error or values)."""
    spec = {"url": url, "options": options, "read": read, "backups": backups, "n": N}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **offline_env()},
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class _Ckpt:
    """A committed checkpoint at ``url``, and the edits an attacker makes to it."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.location = Location.parse(url, storage_options)
        self.fs = fsspec.filesystem(
            self.location.protocol, **storage_options, skip_instance_cache=True
        )
        self.manifest = json.loads(self.get(MANIFEST_KEY))
        self.index_key = next(k for k in self.manifest["metadata"]["index"] if k)

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self.location.key_path(key)))

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.location.key_path(key), data)

    def entry(self, key: str) -> dict[str, Any]:
        return next(o for o in self.manifest["objects"] if o["key"] == key)

    def put_manifest(self, data: bytes | None = None) -> None:
        doc = self.manifest
        doc["total_bytes"] = sum(o["size"] for o in doc["objects"])
        self.put(MANIFEST_KEY, data if data is not None else json.dumps(doc).encode())

    def edit_index(self, edit: Callable[[dict[str, Any]], None]) -> None:
        doc = json.loads(self.get(self.index_key))
        edit(doc)
        self.put_index(json.dumps(doc, separators=(",", ":")).encode())

    def put_index(self, data: bytes) -> None:
        """Replace the index object, and update the manifest to match (size, CRC32C)."""
        self.put(self.index_key, data)
        self.entry(self.index_key).update(size=len(data), crc32c=f"{crc32c.crc32c(data):08x}")
        self.put_manifest()

    def payload_key(self) -> str:
        return next(o["key"] for o in self.manifest["objects"] if o["key"].endswith(".distcp"))


def _saved(target: StoreTarget, name: str) -> _Ckpt:
    save(counting_state(N), target.url(name), target)
    return _Ckpt(target.url(name), target.storage_options)


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


# -- the crafted inputs -------------------------------------------------------------------
def _index_claims_a_tib(ck: _Ckpt) -> str:
    """Every item of the index is 1 TiB long (the index re-encoded, its manifest
    entry updated to match)."""

    ck.edit_index(lambda doc: doc.update(length=columns.pack([TIB] * (len(doc["crc32c"]) // 8))))
    return ck.location.url_of(ck.index_key)


def _index_and_payload_claim_a_tib(ck: _Ckpt) -> str:
    """The tensor's item is 1 TiB long and the manifest says its payload object is
    2 TiB: only the tensor's dtype and shape bound the item."""
    payload = ck.payload_key()

    def edit(doc: dict[str, Any]) -> None:
        w = doc["fqns"].index("w")
        lengths = columns.unpack(doc["length"], len(doc["crc32c"]) // 8, "length")
        fqn = columns.unpack(doc["fqn"], len(lengths), "fqn")
        doc["length"] = [TIB if f == w else n for f, n in zip(fqn, lengths, strict=True)]

    ck.entry(payload)["size"] = 2 * TIB
    ck.edit_index(edit)
    return ck.location.url_of(ck.index_key)


def _chunk_count(ck: _Ckpt) -> str:
    """``"chunks": 300000000`` and runs of that length: a few hundred bytes changed."""
    n = 300_000_000
    ck.manifest["metadata"]["state_dict"]["w"].update(
        chunks=n,
        offsets=[{"runs": [0, 0, n]}],
        sizes=[{"runs": [N, 0, n]}],
        writer={"runs": [0, 0, n]},
    )
    ck.put_manifest()
    return ck.location.url_of(MANIFEST_KEY)


def _deep_manifest(ck: _Ckpt) -> str:
    data = json.dumps(ck.manifest, separators=(",", ":")).encode()
    assert b'"user":{}' in data
    ck.put_manifest(data.replace(b'"user":{}', b'"user":{"x":' + _deep(200_000) + b"}"))
    return ck.location.url_of(MANIFEST_KEY)


def _deep_index(ck: _Ckpt) -> str:
    data = ck.get(ck.index_key)
    ck.put_index(data.replace(b'{"format"', b'{"x":' + _deep(200_000) + b',"format"', 1))
    return ck.location.url_of(ck.index_key)


def _size_text(text: bytes) -> Callable[[_Ckpt], str]:
    def craft(ck: _Ckpt) -> str:
        data = json.dumps(ck.manifest, separators=(",", ":")).encode()
        before = f'"size":[{N}]'.encode()
        assert before in data
        ck.put_manifest(data.replace(before, b'"size":[' + text + b"]"))
        return ck.location.url_of(MANIFEST_KEY)

    craft.__name__ = f"size_{text.decode()}"
    return craft


def _size_as_runs(ck: _Ckpt) -> str:
    """The tensor's size written as a column of runs, as its chunk columns may be:
    the manifest's own checks pass, its DCP metadata does not decode."""
    ck.manifest["metadata"]["state_dict"]["w"]["size"] = {"runs": [N, 0, 1]}
    ck.put_manifest()
    return ck.location.url_of(MANIFEST_KEY)


def _index_offset_2_70(ck: _Ckpt) -> str:
    ck.edit_index(lambda doc: doc.update(offset=[2**70] * (len(doc["crc32c"]) // 8)))
    return ck.location.url_of(ck.index_key)


CRAFTED = [
    _index_claims_a_tib,
    _index_and_payload_claim_a_tib,
    _chunk_count,
    _deep_manifest,
    _deep_index,
    _size_text(b"1e400"),
    _size_text(str(2**70).encode()),
    _size_as_runs,
    _index_offset_2_70,
]


def _outside(proxy: FaultProxy, prefix: str) -> list[str]:
    """Object requests the proxy saw for keys outside ``prefix``."""
    return [
        f"{s.operation} {s.path}"
        for s in proxy.seen
        if s.operation in ("GetObject", "HeadObject") and not s.path.startswith(prefix)
    ]


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
