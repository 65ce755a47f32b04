"""Referencing steps made by hand from committed ones, for the lifecycle tests.

A step saved with reuse names another step's objects as ``../step-<N>/<key>``
(:mod:`objckpt.format.refs`). :func:`craft_reference_step` makes such a step from a
committed one without a save: a new attempt whose manifest (format 3), index objects
and ``.metadata`` name every payload of the base step by reference (a reference
the base holds stays as it is, so chains never form), with sizes and CRC32Cs copied
from the base manifest and the rewritten objects' CRC32Cs recomputed. It is what a
reusing save of an unchanged state commits, so gc, retention, verify, backups,
promotion and ``cp`` can be tested on it on their own.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

from objckpt import Location
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    index_key,
    index_rank,
    new_attempt_id,
)
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.format.refs import reference_key
from objckpt.format.steps import step_name
from objckpt.writers import open_store
from objckpt.writers.checksum import Crc32c


def _crc(data: bytes) -> str:
    c = Crc32c()
    c.update(data)
    return c.hexdigest()


def craft_reference_step(
    root: str, base: int, step: int, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """Commit ``<root>/step-<step>`` naming every payload of committed step ``base``
    by reference; returns its manifest."""
    loc = Location.parse(root, storage_options or {})
    base_dir = step_name(base)
    src = open_store(loc.child(base_dir))
    dst = open_store(loc.child(step_name(step)))
    try:
        manifest = read_manifest(src)
        attempt = new_attempt_id()
        renamed: dict[str, str] = {}
        entries: list[ObjectEntry] = []
        for entry in manifest.objects:
            rank = index_rank(entry.key)
            if entry.key == METADATA_KEY:
                continue
            if rank is not None:
                doc = json.loads(src.read(entry.key))
                doc["attempt"] = attempt
                doc["keys"] = [reference_key(base_dir, k) for k in doc["keys"]]
                data = json.dumps(doc, separators=(",", ":")).encode()
                new_key = index_key(rank, attempt)
                dst.put(new_key, data)
                renamed[entry.key] = new_key
                entries.append(ObjectEntry(new_key, len(data), _crc(data)))
            else:
                ref = reference_key(base_dir, entry.key)
                entries.append(ObjectEntry(ref, entry.size, entry.crc32c))
        md_bytes = _metadata(src.read(METADATA_KEY), base_dir)
        entries.insert(0, ObjectEntry(METADATA_KEY, len(md_bytes), _crc(md_bytes)))
        metadata = dict(manifest.metadata)
        if "index" in metadata:
            metadata["index"] = [renamed.get(k, k) for k in metadata["index"]]
        crafted = dataclasses.replace(
            manifest,
            attempt=attempt,
            created=Manifest.now(),
            objects=tuple(entries),
            metadata=metadata,
            requests=None,
        )
        dst.put(MANIFEST_KEY, crafted.to_json_bytes())
        dst.put(METADATA_KEY, md_bytes)
        return read_manifest(dst)
    finally:
        src.close()
        dst.close()


def _metadata(blob: bytes, base_dir: str) -> bytes:
    """The base's pickled DCP ``Metadata`` with every relative path a reference."""
    md = pickle.loads(blob)
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=reference_key(base_dir, v.relative_path))
        for k, v in md.storage_data.items()
    }
    return pickle.dumps(md)
