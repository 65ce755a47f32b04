"""The local tier as a reader sees it: this node's copy of a checkpoint, trusted per object.

A copy on local disk (the local tier of :class:`~objckpt.LocalTier`) may hold all of
a checkpoint, only this rank's part of it, or damaged bytes. So it is never trusted
as a whole: an object is read from it when it is there with the manifest's size,
its bytes are checked before use, and an object found wrong is logged, naming the
local object, and read from the store for the rest of the load. The choice is per
object, so a job restarted on another world size reads whatever mix of tiers holds
the bytes.

A copy whose directory is a symbolic link is not used at all: the local tier never
follows a link at a step's name (it neither lists, writes nor deletes through one,
see :mod:`objckpt.ops.tier.local_disk`), and reading through one would make a step the
tier does not list load from a directory it does not own. Every file is read
through the node's one door (:class:`~objckpt.writers.node_store.NodeStore`), so a
link anywhere under the tier, the file's own name included, is refused, not read.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from objckpt.errors import (
    ChecksumMismatchError,
    LinkRefusedError,
    ObjckptError,
    SizeMismatchError,
)
from objckpt.format.dcp_json import StoredItem
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.node_store import NodeStore, tier_store

__all__ = ["LocalCopy"]

logger = logging.getLogger(__name__)


def _link_refusal(location: Location) -> str | None:
    """Why the directory ``location`` is not looked in (a link), else None."""
    store, rel = tier_store(location.path.rstrip("/"))
    try:
        store.stat(rel)
    except LinkRefusedError as exc:
        return str(exc)
    except (OSError, ObjckptError):
        return None
    return None


class LocalCopy:
    """A local directory holding (some of) a checkpoint's objects under the store's names.

    Args:
        location: The local directory.
        store: The checkpoint in the store that the copy stands in for.
        also: Further local directories holding objects of the same checkpoint
            (the local tier's replicas of other nodes' files), looked in, in order,
            for what ``location`` lacks.

    Attributes:
        location: The local directory.
        bytes_read: Bytes taken from the copy over this object's life.
    """

    def __init__(self, location: Location, store: Location, also: Sequence[Location] = ()) -> None:
        self.location = location
        #: Every directory looked in, in order, with the store it is reached through
        #: (links never: see the module docstring).
        self._dirs = [
            (d, tier_store(d.path.rstrip("/"))[0])
            for d in [location, *(d for d in also if _link_refusal(d) is None)]
        ]
        #: Where each key was found (the first directory holding a file of its name):
        #: the store and the file's path under its root (None: outside it).
        self._paths: dict[str, tuple[NodeStore, str | None]] = {}
        self.bytes_read = 0
        self._store = store
        #: The manifest's objects (None: no manifest, so nothing local can be
        #: checked, and nothing local is used).
        self._objects: Mapping[str, ObjectEntry] | None = None
        #: Objects found usable (True) or not (False), by key.
        self._ok: dict[str, bool] = {}
        #: Files whose bytes were found wrong (not merely unreadable): key -> (the
        #: file, why), over this object's life.
        self.damaged: dict[str, tuple[str, str]] = {}
        refusal = _link_refusal(location)
        self._linked = refusal is not None
        if refusal is not None:
            logger.warning(
                "local copy %s is not used (%s), so every object is read from %s",
                location.path,
                refusal,
                store.url,
            )

    def read_manifest(self, store_url: str) -> bytes | None:
        """The copy's manifest when it is there and parses (else None, logged)."""
        if self._linked:
            return None
        try:
            with self._open(MANIFEST_KEY) as f:
                data = f.read()
            Manifest.from_json_bytes(data, url=self.location.url_of(MANIFEST_KEY))
        except FileNotFoundError:
            return None
        except Exception as exc:
            logger.warning(
                "local copy %s is unusable (%s); reading the manifest from %s",
                self.location.url_of(MANIFEST_KEY),
                exc,
                store_url,
            )
            return None
        return data

    def start(self, store: Location, objects: Mapping[str, ObjectEntry] | None) -> None:
        """Begin a load of ``store``, whose manifest lists ``objects`` (None: it has
        none); what earlier loads found about the copy is forgotten."""
        self._store, self._objects, self._ok, self._paths = store, objects, {}, {}

    def _file(self, key: str) -> tuple[NodeStore, str | None]:
        """The file that stands for ``key``: in the first directory holding one, as
        its store and its path under the store's root (None: outside the root)."""
        where = self._paths.get(key)
        if where is None:
            held = [(store, self._rel(d, store, key)) for d, store in self._dirs]
            where = held[0]
            entry = None if self._objects is None else self._objects.get(key)
            found = [(s, rel) for s, rel in held if rel is not None and s.exists(rel)]
            if found:
                where = found[0]
            if entry is not None:  # the first copy of the manifest's size, when one is
                for store, rel in found:
                    with contextlib.suppress(OSError, ObjckptError):
                        if rel is not None and store.stat(rel).st_size == entry.size:
                            where = (store, rel)
                            break
            self._paths[key] = where
        return where

    @staticmethod
    def _rel(directory: Location, store: NodeStore, key: str) -> str | None:
        """``key``'s file in ``directory`` relative to ``store``'s root (a reference
        to a sibling step resolved), None when it leaves the root."""
        rel = os.path.relpath(directory.key_path(key), store.root)
        return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel

    def _key_path(self, key: str) -> str:
        """The file that stands for ``key``, for messages."""
        store, rel = self._file(key)
        return self.location.key_path(key) if rel is None else os.path.join(store.root, rel)

    def _open(self, key: str) -> io.BufferedReader:
        """The file that stands for ``key``, opened through the node's door."""
        store, rel = self._file(key)
        if rel is None:
            raise FileNotFoundError(errno.ENOENT, "outside the local copy", self._key_path(key))
        return store.open_read(rel)

    def holds(self, key: str) -> bool:
        """Whether ``key`` is read from the copy: there, with the manifest's size."""
        if self._objects is None or self._linked:
            return False
        known = self._ok.get(key)
        if known is not None:
            return known
        entry = self._objects.get(key)
        store, rel = self._file(key)
        try:
            size = None if rel is None else store.stat(rel).st_size
        except (OSError, ObjckptError):
            size = None
        ok = entry is not None and size == entry.size
        if size is not None and not ok:
            logger.warning(
                "local copy %s has %d bytes, the manifest says %s; reading it from %s",
                self.location.url_of(key),
                size,
                entry.size if entry else "nothing",
                self._store.url,
            )
        self._ok[key] = ok
        return ok

    def distrust(self, key: str, why: str, *, damaged: bool = True) -> None:
        """Read ``key`` from the store from now on, logging ``why``; ``damaged``:
        its bytes were read and found wrong (listed in :attr:`damaged`)."""
        if damaged:
            self.damaged[key] = (self._key_path(key), why)
        logger.warning(
            "local copy %s is corrupt (%s); reading it from %s instead",
            self.location.url_of(key),
            why,
            self._store.url_of(key),
        )
        self._ok[key] = False

    def read_object(self, key: str, check: Callable[[bytes], None]) -> bytes | None:
        """A whole object, or None when ``check`` finds it damaged (then distrusted).

        Raises:
            OSError: The object could not be read.
        """
        with self._open(key) as f:
            blob = f.read()
        try:
            check(blob)
        except (SizeMismatchError, ChecksumMismatchError) as exc:
            self.distrust(key, str(exc))
            return None
        self.bytes_read += len(blob)
        return blob

    def read_span(
        self, key: str, start: int, end: int, items: Iterable[StoredItem], verify: bool
    ) -> bytes | None:
        """Bytes ``start``-``end`` of ``key``, each of ``items`` checked when ``verify``;
        None when the span is not usable (then ``key`` is distrusted)."""
        try:
            with self._open(key) as f:
                f.seek(start)
                data = f.read(end - start)
        except OSError as exc:
            self.distrust(key, str(exc), damaged=False)
            return None
        if len(data) != end - start:
            self.distrust(key, f"{len(data)} bytes at {start}, not {end - start}")
            return None
        if verify:
            view = memoryview(data)
            for item in items:
                if item.crc32c is None:
                    continue
                crc = Crc32c()
                crc.update(view[item.offset - start : item.offset - start + item.length])
                if crc.hexdigest() != item.crc32c:
                    self.distrust(
                        key,
                        f"CRC32C of bytes {item.offset}-{item.offset + item.length} is "
                        f"{crc.hexdigest()}, the manifest says {item.crc32c}",
                    )
                    return None
        self.bytes_read += len(data)
        return data
