"""The manifest: the one object whose existence commits a checkpoint.

It is versioned JSON (never pickle, so reading it cannot run code) and holds
everything objckpt's reader needs: the list of payload objects with size and
CRC32C, and the DCP metadata in JSON form. Parsing validates every field, so a
damaged or hostile manifest is refused with a message naming its URL rather
than failing somewhere deep in a load. The checks (size, JSON depth and numbers,
keys that stay inside the checkpoint) are the reader's one validation boundary,
:mod:`objckpt.format.bounds`, so a crafted manifest cannot make the reader fetch
anything else or spend unbounded memory.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from objckpt.errors import ManifestError
from objckpt.format.bounds import check_key, load_json
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.refs import is_reference, names_spread
from objckpt.writers.accounting import RequestStats

if TYPE_CHECKING:
    from objckpt.writers.base import ObjectStore

__all__ = [
    "FORMAT",
    "REFERENCES_VERSION",
    "SPREAD_VERSION",
    "VERSION",
    "Manifest",
    "ObjectEntry",
    "check_key",
    "read_manifest",
]

FORMAT = "objckpt.manifest"
#: Written since format 2 (compact metadata + per-rank index objects,
#: :mod:`objckpt.format.index`); format 1 (every item a record here) still loads.
VERSION = 2
#: Written for a manifest that names another step's objects (``../step-N/<key>``,
#: reuse of unchanged items, #28): an objckpt that predates references refuses it
#: ("upgrade") instead of looking for those objects inside the step.
REFERENCES_VERSION = 3
#: Written for a manifest that names spread keys (``spread-3f/<name>``, stored in
#: front of the step's directory: ``UploadOptions(persistent_prefixes=True)``): an
#: objckpt before it would look for those objects inside the step. The newest
#: version this objckpt reads.
SPREAD_VERSION = 4


@dataclasses.dataclass(frozen=True)
class ObjectEntry:
    """One object of a checkpoint: key relative to the checkpoint URL, size, CRC32C."""

    key: str
    size: int
    crc32c: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "crc32c": self.crc32c}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed manifest (see DESIGN.md §3 for the JSON layout)."""

    attempt: str
    created: str
    world_size: int
    objckpt_version: str
    torch_version: str
    objects: tuple[ObjectEntry, ...]
    metadata: Mapping[str, Any]
    user: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    version: int = VERSION
    #: Store requests the save made before this manifest's own PUT, all ranks
    #: together (None when unknown: older manifests, stores that are not counted).
    requests: RequestStats | None = None
    #: Whether the save writes ``.metadata`` for stock DCP readers: named here, or
    #: written after the commit (True); or not at all (False: a save above
    #: ``UploadOptions.stock_metadata_max_ranks``, whose ``.metadata``
    #: :func:`objckpt.write_stock_metadata` writes on demand, unnamed).
    stock_metadata: bool = True

    @property
    def total_bytes(self) -> int:
        """Bytes of every object the step needs, referenced ones included."""
        return sum(o.size for o in self.objects)

    @property
    def reused_bytes(self) -> int:
        """Bytes of the objects this step references in other steps (not stored by it)."""
        return sum(o.size for o in self.objects if is_reference(o.key))

    @property
    def written_version(self) -> int:
        """The format version this manifest is written with: 4 when it names objects
        in spread directories (its own or another step's), 3 when it references
        another step's objects or holds compressed items (``raw_bytes``: readers
        before version 3 would misread either, and refuse a newer version by name),
        its own version otherwise."""
        if any(names_spread(o.key) for o in self.objects):
            return max(self.version, SPREAD_VERSION)
        compressed = "raw_bytes" in self.metadata
        if compressed or any(is_reference(o.key) for o in self.objects):
            return max(self.version, REFERENCES_VERSION)
        return self.version

    def object(self, key: str) -> ObjectEntry | None:
        for o in self.objects:
            if o.key == key:
                return o
        return None

    @staticmethod
    def now() -> str:
        return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def to_json_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": self.written_version,
            "attempt": self.attempt,
            "created": self.created,
            "world_size": self.world_size,
            "objckpt_version": self.objckpt_version,
            "torch_version": self.torch_version,
            "total_bytes": self.total_bytes,
            "objects": [o.to_json() for o in self.objects],
            "metadata": self.metadata,
            "user": dict(self.user),
        }
        reused = self.reused_bytes
        if reused:
            doc["reused_bytes"] = reused
        if self.requests is not None:
            doc["requests"] = self.requests.to_json()
        if not self.stock_metadata:  # absent means written (every manifest before #46's)
            doc["stock_metadata"] = False
        return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes, *, url: str, max_bytes: int | None = None) -> Manifest:
        """Parse and validate; raises ManifestError naming ``url`` on any problem.

        Args:
            data: The manifest's bytes.
            url: Its URL, for messages.
            max_bytes: ``ReadOptions.max_metadata_bytes`` (None: its default).
        """
        doc = load_json(data, what="manifest", url=url, max_bytes=max_bytes)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{url} is not an objckpt manifest (format != {FORMAT!r})")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"manifest {url} has no valid format version")
        if version > SPREAD_VERSION:
            raise ManifestError(
                f"manifest {url} has format version {version}, newer than this objckpt "
                f"understands ({SPREAD_VERSION}); upgrade objckpt to load it"
            )

        def field(name: str, kind: type | tuple[type, ...]) -> Any:
            value = doc.get(name)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
                raise ManifestError(f"manifest {url}: field {name!r} is missing or not {kind}")
            return value

        objects = []
        for i, raw in enumerate(field("objects", list)):
            where = f"manifest {url}, objects[{i}]"
            if not isinstance(raw, dict):
                raise ManifestError(f"{where} is not an object")
            size, crc = raw.get("size"), raw.get("crc32c")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ManifestError(f"{where}: size must be a non-negative integer")
            if (
                not isinstance(crc, str)
                or len(crc) != 8
                or any(c not in "0123456789abcdef" for c in crc)
            ):
                raise ManifestError(f"{where}: crc32c must be 8 lowercase hex digits")
            key = check_key(raw.get("key"), where)
            if is_reference(key) and version < REFERENCES_VERSION:
                raise ManifestError(
                    f"{where}: reference {key!r} in a format-{version} manifest (references "
                    f"need format {REFERENCES_VERSION})"
                )
            if names_spread(key) and version < SPREAD_VERSION:
                raise ManifestError(
                    f"{where}: spread key {key!r} in a format-{version} manifest (spread "
                    f"keys need format {SPREAD_VERSION})"
                )
            objects.append(ObjectEntry(key, size, crc))
        manifest = cls(
            attempt=field("attempt", str),
            created=field("created", str),
            world_size=field("world_size", int),
            objckpt_version=field("objckpt_version", str),
            torch_version=field("torch_version", str),
            objects=tuple(objects),
            metadata=field("metadata", dict),
            user=doc.get("user") or {},
            version=version,
            requests=RequestStats.from_json(doc.get("requests")),
            stock_metadata=doc.get("stock_metadata", True),
        )
        if not isinstance(manifest.stock_metadata, bool):
            raise ManifestError(f"manifest {url}: stock_metadata must be true or false")
        if not manifest.stock_metadata and manifest.object(METADATA_KEY) is not None:
            raise ManifestError(f"manifest {url} names {METADATA_KEY} and says its save wrote none")
        total = doc.get("total_bytes")
        if total != manifest.total_bytes:
            raise ManifestError(f"manifest {url}: total_bytes {total!r} != sum of object sizes")
        reused = doc.get("reused_bytes", 0)
        if reused != manifest.reused_bytes:
            raise ManifestError(
                f"manifest {url}: reused_bytes {reused!r} != the {manifest.reused_bytes} bytes "
                "of the objects it references in other steps"
            )
        return manifest


def read_manifest(store: ObjectStore) -> Manifest:
    """Read and validate the manifest at ``store.location`` (FileNotFoundError if none)."""
    data = store.read(MANIFEST_KEY)
    return Manifest.from_json_bytes(data, url=store.location.url_of(MANIFEST_KEY))
