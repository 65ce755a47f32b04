"""Waiting for a backup the store fills itself (bucket replication): polls that read
each object at most once.

Why a module of its own: a ``replicated`` backup target (:mod:`objckpt.ops.run.backup`)
is filled by the store (S3 Cross-Region Replication, a GCS transfer job), and
objckpt only checks it, poll after poll, until the step's manifest and every object
it names are there and match, and the ``.metadata`` the primary wrote after its commit
(no manifest names it; stock DCP readers need it) where the primary holds this
attempt's. Each object is checked by the full-object CRC32C the
store keeps where it keeps one (one HEAD; S3 replicates the checksum objckpt's
uploads ask for), else by reading it back across regions. Done on every poll, that
read was the bill: a step whose last object arrives late had every other object
streamed again on each poll.

:class:`VerifiedObjects` remembers what matched, by path, with the size and ETag
(GCS: generation) the store reported: a later poll, or a later step naming the same
bytes, costs one HEAD per such object, and an object whose tag changed is checked
again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import posixpath
import time
from collections.abc import Iterable, Sequence

from objckpt.errors import BackupError
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.ops.maintain.verify import check_backup_copy, unnamed_metadata_entry
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location

__all__ = ["VerifiedObjects", "await_backup", "poll_backup", "replica_manifest"]

#: What a check found for one object: the store's (size, tag) and the manifest
#: entry's (size, CRC32C) it matched.
_Verified = tuple[tuple[int, str], int, str]


def _identity(store: ObjectStore, key: str) -> tuple[int, str] | None:
    """An object's size and the tag the store changes whenever its bytes change
    (S3's ETag, GCS's generation); None when it is absent or the store has none."""
    try:
        head = store.head(key)
    except Exception:  # absent or unreadable: checked, and reported, the long way
        return None
    return (head.size, head.tag) if head.tag else None


class VerifiedObjects:
    """The objects of one replicated target found to match a manifest entry.

    An entry holds while HEAD reports the size and tag seen right after the check
    and the manifest names the same size and CRC32C. Used from the replicator's one
    thread; the HEADs of a poll run in parallel and are gathered before it changes.
    """

    def __init__(self) -> None:
        self._seen: dict[str, _Verified] = {}

    @staticmethod
    def _path(store: ObjectStore, key: str) -> str:
        return posixpath.normpath(store.path(key))  # "../step-…/x" names one object

    def unchanged(
        self, store: ObjectStore, entries: Sequence[ObjectEntry], pool: concurrent.futures.Executor
    ) -> set[str]:
        """Keys of ``entries`` verified before and unchanged since: one HEAD for each
        remembered object, none for the others."""
        known = [e for e in entries if self._path(store, e.key) in self._seen]
        idents = pool.map(lambda e: _identity(store, e.key), known)
        out = set()
        for entry, ident in zip(known, idents, strict=True):
            path = self._path(store, entry.key)
            if ident is not None and (ident, entry.size, entry.crc32c) == self._seen.get(path):
                out.add(entry.key)
            else:
                self._seen.pop(path, None)
        return out

    def add(
        self, store: ObjectStore, entries: Sequence[ObjectEntry], pool: concurrent.futures.Executor
    ) -> None:
        """Remember ``entries``, just found to match (one HEAD each)."""
        idents = pool.map(lambda e: _identity(store, e.key), entries)
        for entry, ident in zip(entries, idents, strict=True):
            if ident is not None:
                self._seen[self._path(store, entry.key)] = (ident, entry.size, entry.crc32c)

    def keep_only(self, store: ObjectStore, entries: Iterable[ObjectEntry]) -> None:
        """Forget all but ``entries`` (the newest step's objects, which the next step
        may name again): memory follows one step, not the run."""
        keep = {self._path(store, e.key) for e in entries}
        self._seen = {p: v for p, v in self._seen.items() if p in keep}

    def __len__(self) -> int:
        return len(self._seen)


def replica_manifest(source: Location, manifest: Manifest) -> Manifest:
    """``manifest`` with what its replica must hold besides the objects it names: the
    ``.metadata`` ``source`` holds for its attempt where the manifest does not name
    it (an async save of several ranks writes it after the commit, and
    ``write_stock_metadata`` on demand). Replication copies each object on its own
    and in no order, so a replica whose manifest and payloads arrived may still lack
    it, or hold another attempt's: stock DCP readers could not load it, or would load
    the wrong checkpoint. Read once per step, as a copy reads it
    (:func:`~objckpt.ops.maintain.verify.unnamed_metadata_entry`); where the primary
    has none for this attempt, or it cannot be read (logged), nothing is added."""
    if manifest.object(METADATA_KEY) is not None:
        return manifest
    store = open_store(source)
    try:
        entry = unnamed_metadata_entry(store, manifest.attempt)
    finally:
        store.close()
    if not isinstance(entry, ObjectEntry):
        return manifest
    return dataclasses.replace(manifest, objects=(*manifest.objects, entry))


def poll_backup(
    verified: VerifiedObjects,
    store: ObjectStore,
    manifest: Manifest,
    pool: concurrent.futures.Executor,
) -> str | None:
    """One look at the replica ``store`` holds: None when its manifest is
    ``manifest``'s attempt and every object matches, else why not. Objects in
    ``verified`` and unchanged are not checked again; those that match now join it."""
    dest = store.location
    known = verified.unchanged(store, manifest.objects, pool)
    rest = tuple(e for e in manifest.objects if e.key not in known)
    found = check_backup_copy(dest, dataclasses.replace(manifest, objects=rest))
    if isinstance(found, str):
        return found
    good = {c.key for c in found if c.problem is None}
    verified.add(store, [e for e in rest if e.key in good], pool)
    bad = [c for c in found if c.problem is not None]
    return f"{dest.url_of(bad[0].key)}: {bad[0].problem}" if bad else None


def await_backup(
    verified: VerifiedObjects,
    dest: Location,
    manifest: Manifest,
    *,
    timeout: float,
    interval: float,
) -> None:
    """Poll ``dest`` every ``interval`` seconds until it holds ``manifest``'s
    checkpoint whole (``manifest`` as :func:`replica_manifest` returns it: with the
    primary's unnamed ``.metadata``); then ``verified`` keeps that step's objects only.

    Raises:
        BackupError: Not in place after ``timeout`` seconds (says what is missing).
    """
    deadline = time.monotonic() + timeout
    store = open_store(dest)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            while True:
                why = poll_backup(verified, store, manifest, pool)
                if why is None:
                    verified.keep_only(store, manifest.objects)
                    return
                if time.monotonic() >= deadline:
                    raise BackupError(f"replica not in place after {timeout:.0f} s: {why}")
                time.sleep(interval)
    finally:
        store.close()
