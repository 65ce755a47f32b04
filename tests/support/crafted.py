"""Crafted checkpoints: real ones objckpt wrote, edited as an attacker with write access
to the bucket would, and a child process that loads one under a 4 GiB address-space limit.

Shared by tests/format/test_untrusted_input.py (every store family) and
tests/store/test_rgw.py (the same crafts on Ceph RGW).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import crc32c
import fsspec
from helpers import save
from states import counting_state

from objckpt import Location
from objckpt.format import columns
from objckpt.format.layout import MANIFEST_KEY
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget
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
