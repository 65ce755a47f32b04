"""A commit split by rank: each rank writes its own index, the coordinator the rest.

Each rank, once its uploads ended, writes its index object (format/index.py)
and reports a :class:`RankReport`: its index object's key, size and CRC32C, its
payload objects' (a count bounded by its own objects, whatever the world size)
and its request totals. That report is what travels through the c10d store, so a
rank's bytes per save do not grow with the world size, and the coordinator decodes
W small records instead of every rank's write results.

The coordinator's manifest needs the plan's chunk layout (:class:`Layout`, built
once per global plan) and which rank wrote each chunk, which, like DCP's
``.metadata``, needs every index; both come from rank 0's commit helper
(:mod:`objckpt.pipeline.stock_task`), off the training process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from objckpt.format.commit import written_objects
from objckpt.format.dcp_json import StoredItem, encode_storage_meta
from objckpt.format.index import encode_rank_index, layout_doc
from objckpt.format.manifest import ObjectEntry
from objckpt.writers.accounting import RequestStats
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import Crc32c

__all__ = ["Layout", "RankReport", "write_rank_index"]

#: The DCP metadata format version DCP's own writers stamp (as format/commit.py).
_DCP_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What one rank reports for the commit (small: see the module doc).

    Attributes:
        index: This rank's index object (None: it stored no item).
        objects: The payload objects its items are in.
        requests: Its store requests so far, its index PUT included.
    """

    index: ObjectEntry | None
    objects: tuple[ObjectEntry, ...]
    requests: RequestStats


def write_rank_index(
    store: ObjectStore,
    results: Iterable[WriteResult],
    rank: int,
    attempt: str,
    requests: Callable[[], RequestStats],
) -> RankReport:
    """Encode and PUT this rank's index object; its report (``requests`` is read
    after the PUT, so the report counts it).

    Raises:
        ManifestError: An item has no chunk position.
        StoreError: The PUT failed (the save must fail on every rank).
    """
    results = list(results)
    items = {wr.index: wr.storage_data for wr in results if isinstance(wr.storage_data, StoredItem)}
    objects = written_objects(results)
    if not items:
        return RankReport(None, objects, requests())
    shard = encode_rank_index(items, rank, attempt)
    store.put(shard.key, shard.data)
    crc = Crc32c()
    crc.update(shard.data)
    return RankReport(ObjectEntry(shard.key, len(shard.data), crc.hexdigest()), objects, requests())


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the manifest and ``.metadata`` take from one global plan (kept while the
    plan is reused: building it costs O(chunks), a save with it O(tensors)).

    Attributes:
        doc: The manifest's ``metadata`` without writers or index keys.
        placeholder: ``doc`` with a writer any reader accepts on every entry (what
            the helper decodes the index objects against).
        properties: Each tensor's ``TensorProperties`` (for ``.metadata``).
    """

    doc: dict[str, Any]
    placeholder: dict[str, Any]
    properties: dict[str, TensorProperties]

    @classmethod
    def of(cls, metadata: Metadata) -> Layout:
        doc = layout_doc(dataclasses.replace(metadata, version=_DCP_VERSION), "0" * 16)
        state = {
            fqn: entry if "writer" in entry else {**entry, "writer": 0}
            for fqn, entry in doc["state_dict"].items()
        }
        properties = {
            fqn: md.properties
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        return cls(doc, {**doc, "state_dict": state}, properties)

    def for_save(
        self, placeholder: bool, index_keys: Sequence[str | None], storage_meta: StorageMeta
    ) -> dict[str, Any]:
        """The document of one save: its index keys and ``StorageMeta``."""
        base = self.placeholder if placeholder else self.doc
        return {
            **base,
            "index": list(index_keys),
            "storage_meta": encode_storage_meta(storage_meta),
        }
