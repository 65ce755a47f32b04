"""Checking and copying committed checkpoints without loading them into torch.

``verify_checkpoint`` reads every object the manifest names and compares its
size and CRC32C with the manifest: the check a job should be able to run on a
checkpoint before trusting it (or before deleting the only other copy).

``copy_checkpoint`` streams each object from one store to another, checking
the CRC32C on the way, then commits as a save does (:mod:`objckpt.format.settle`):
one listing proves every object arrived, the manifest goes create-only (settled by
reading it back on any error), and ``.metadata`` only after it. A copy that stops
half-way is, like a failed save, invisible and garbage for ``gc``; a copy that
fails or loses onto a committed destination leaves every byte of it unchanged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ManifestError,
    SizeMismatchError,
)
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, list_names
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.format.settle import after_commit, put_manifest, require_present
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = [
    "CopyReport",
    "ObjectCheck",
    "VerifyReport",
    "check_replica",
    "commit_copy",
    "copy_checkpoint",
    "copy_object",
    "open_manifest",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024
Progress = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class ObjectCheck:
    """One object's check. ``problem`` is None when size and CRC32C match."""

    key: str
    size: int
    crc32c: str
    actual_size: int | None
    actual_crc32c: str | None
    problem: str | None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    url: str
    manifest: Manifest
    objects: tuple[ObjectCheck, ...]

    @property
    def ok(self) -> bool:
        return all(o.problem is None for o in self.objects)

    @property
    def failures(self) -> tuple[ObjectCheck, ...]:
        return tuple(o for o in self.objects if o.problem is not None)


def open_manifest(store: ObjectStore) -> Manifest:
    """The committed manifest at ``store.location``.

    Raises:
        CheckpointNotFoundError: Nothing is there.
        CheckpointNotCommittedError: Objects but no manifest (a failed or running save).
        ManifestError: The manifest is invalid.
    """
    try:
        return read_manifest(store)
    except FileNotFoundError:
        url = store.location.url
        if list_names(store.fs, store.location.path):
            raise CheckpointNotCommittedError(
                f"{url} has no {MANIFEST_KEY}: the save that wrote it never committed"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {url}") from None


def _stream(
    store: ObjectStore, key: str, sink: Callable[[bytes], object], progress: Progress | None
) -> tuple[int, str]:
    """Read one object in chunks; returns (size, crc32c)."""
    crc = Crc32c()
    size = 0
    try:
        with store.fs.open(store.path(key), "rb", block_size=_CHUNK) as f:
            while chunk := f.read(_CHUNK):
                crc.update(chunk)
                size += len(chunk)
                sink(chunk)
                if progress is not None:
                    progress(len(chunk))
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise translate(exc, url=store.location.url_of(key), action="reading") from exc
    return size, crc.hexdigest()


def _check(store: ObjectStore, entry: ObjectEntry, progress: Progress | None) -> ObjectCheck:
    def problem(msg: str, size: int | None = None, crc: str | None = None) -> ObjectCheck:
        return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, msg)

    try:
        size, crc = _stream(store, entry.key, lambda _: None, progress)
    except FileNotFoundError:
        return problem("missing")
    if size != entry.size:
        return problem(f"size {size} != {entry.size} in the manifest", size, crc)
    if crc != entry.crc32c:
        return problem(f"CRC32C {crc} != {entry.crc32c} in the manifest", size, crc)
    return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, None)


def verify_checkpoint(
    location: Location,
    *,
    manifest: Manifest | None = None,
    progress: Progress | None = None,
    parallel: int = 4,
) -> VerifyReport:
    """Read every object of a committed checkpoint and check it against the manifest.

    Args:
        manifest: The checkpoint's manifest when the caller has read it already.
        progress: Called with bytes read, as reading goes (from worker threads).

    Raises:
        CheckpointNotFoundError, CheckpointNotCommittedError, ManifestError,
        StoreError: the checkpoint cannot be verified at all. Object mismatches
        are reported in the returned report, every one of them.
    """
    store = open_store(location)
    try:
        manifest = manifest or open_manifest(store)
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            checks = list(pool.map(lambda e: _check(store, e, progress), manifest.objects))
    finally:
        store.close()
    for c in checks:
        if c.problem:
            logger.error("%s: %s", location.url_of(c.key), c.problem)
    return VerifyReport(location.url, manifest, tuple(checks))


def _digest_check(
    dst: ObjectStore, entry: ObjectEntry, progress: Progress | None, *, source: str
) -> ObjectCheck:
    """Check ``dst``'s copy of ``entry``: the store's own full-object CRC32C when
    it keeps one (no payload read), else read the object back."""
    try:
        size, crc = dst.digest(entry.key)
    except FileNotFoundError:
        return ObjectCheck(entry.key, entry.size, entry.crc32c, None, None, "missing")
    if crc is None:
        return _check(dst, entry, progress)
    if progress is not None:
        progress(entry.size)
    problem = None
    if size != entry.size:
        problem = f"size {size} != {entry.size} in the manifest of {source}"
    elif crc != entry.crc32c:
        problem = f"CRC32C {crc} != {entry.crc32c} in the manifest of {source}"
    return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, problem)


def copy_object(
    src: ObjectStore, dst: ObjectStore, entry: ObjectEntry, progress: Progress | None
) -> bool:
    """Copy one object, checked against the manifest; True when copied server-side."""
    if dst.copy_from(src, entry.key, entry.size):
        check = _digest_check(dst, entry, progress, source=src.location.url)
        if check.problem is not None:
            with contextlib.suppress(Exception):  # never committed; gc removes it otherwise
                dst.delete(entry.key)
            cls = SizeMismatchError if check.problem.startswith("size") else ChecksumMismatchError
            raise cls(f"server-side copy of {src.location.url_of(entry.key)}: {check.problem}")
        return True
    if entry.key == METADATA_KEY:  # small; written after the commit (replaced on an overwrite)
        chunks: list[bytes] = []
        size, crc = _stream(src, entry.key, chunks.append, progress)
        _check_copy(src, entry, size, crc)
        dst.put(entry.key, b"".join(chunks))
        return False
    upload = dst.begin(entry.key, entry.size)
    try:
        size, crc = _stream(src, entry.key, upload.write, progress)
        _check_copy(src, entry, size, crc)
        upload.close().result()
    except BaseException:
        upload.abort()
        raise
    return False


def _check_copy(src: ObjectStore, entry: ObjectEntry, size: int, crc: str) -> None:
    where = src.location.url_of(entry.key)
    if size != entry.size:
        raise SizeMismatchError(f"{where} is {size} bytes, the manifest says {entry.size}")
    if crc != entry.crc32c:
        raise ChecksumMismatchError(f"{where} has CRC32C {crc}, the manifest says {entry.crc32c}")


@dataclasses.dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_checkpoint` did.

    Attributes:
        copied: False when ``dst`` already held this very checkpoint (same attempt).
        server_side: Objects the provider copied itself (no bytes through this host).
        streamed: Objects read here and written to ``dst``.
    """

    src: str
    dst: str
    manifest: Manifest
    copied: bool
    server_side: int
    streamed: int


def check_replica(
    replica: Location, manifest: Manifest, *, parallel: int = 4
) -> tuple[ObjectCheck, ...] | str:
    """Whether ``replica`` holds the checkpoint ``manifest`` describes, object by
    object: a store-kept CRC32C where there is one, else the bytes read back.

    Returns the checks, or a string saying why there is nothing to check yet
    (no manifest, a different attempt).
    """
    store = open_store(replica)
    try:
        try:
            theirs = read_manifest(store)
        except FileNotFoundError:
            return f"no {MANIFEST_KEY} at {replica.url} yet"
        except ManifestError as exc:
            return f"{replica.url}: {exc}"
        if theirs.attempt != manifest.attempt:
            return f"{replica.url} holds attempt {theirs.attempt}, not {manifest.attempt}"
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            return tuple(
                pool.map(
                    lambda e: _digest_check(store, e, None, source="the primary"), manifest.objects
                )
            )
    finally:
        store.close()


def copy_checkpoint(
    src: Location,
    dst: Location,
    *,
    manifest: Manifest | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    parallel: int = 4,
    upload: UploadOptions | None = None,
) -> CopyReport:
    """Copy a committed checkpoint; the manifest is written last, create-only.

    Objects go server-side where both ends are one provider reachable with the
    same options (S3 CopyObject/UploadPartCopy, GCS rewrite), checked by the
    CRC32C the provider computes of the copy; otherwise they stream through this
    host, checked while they stream. Either way a corrupt source never produces a
    committed copy. ``manifest`` is the source's, when the caller has read it.
    A destination already holding the same attempt is left as it is. ``upload``
    sizes the parts of streamed and server-side multipart copies.

    Raises:
        CheckpointNotFoundError, CheckpointNotCommittedError: at ``src``.
        CheckpointExistsError: ``dst`` holds a different committed checkpoint
            (and ``overwrite`` is False).
        IntegrityError: A source object fails its check (nothing committed at ``dst``).
    """
    src_store = open_store(src)
    dst_store = open_store(dst, upload or UploadOptions())
    try:
        manifest = manifest or open_manifest(src_store)
        if dst_store.exists(MANIFEST_KEY):
            with contextlib.suppress(ManifestError, FileNotFoundError):
                if read_manifest(dst_store).attempt == manifest.attempt:
                    logger.info("%s already holds this checkpoint (same attempt)", dst.url)
                    return CopyReport(src.url, dst.url, manifest, False, 0, 0)
            if not overwrite:
                raise CheckpointExistsError(
                    f"{dst.url} already holds a committed checkpoint; pass overwrite to replace it"
                )
        server_side = commit_copy(src_store, dst_store, manifest, progress, parallel, overwrite)
    finally:
        src_store.close()
        dst_store.close()
    streamed = len(manifest.objects) - server_side
    logger.info(
        "copied %s to %s (%d objects server-side, %d streamed)",
        src.url,
        dst.url,
        server_side,
        streamed,
    )
    return CopyReport(src.url, dst.url, manifest, True, server_side, streamed)


def commit_copy(
    src: ObjectStore,
    dst: ObjectStore,
    manifest: Manifest,
    progress: Progress | None,
    parallel: int,
    overwrite: bool,
    objects: tuple[ObjectEntry, ...] | None = None,
) -> int:
    """Copy ``objects`` (default: every object but ``.metadata``), check with one
    listing that all the manifest names but ``.metadata`` is at ``dst``, write the
    manifest (settled by read-back), then copy ``.metadata``. Returns how many
    objects went server-side.

    ``.metadata`` has a fixed name, so writing it before the commit would change a
    committed destination's even when this copy then fails or loses.

    Raises:
        CheckpointExistsError: Another manifest won at ``dst``.
        UploadError: An object is missing at ``dst`` before the commit.
    """
    rest = [e for e in manifest.objects if e.key != METADATA_KEY]
    todo = rest if objects is None else [e for e in objects if e.key != METADATA_KEY]
    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = [pool.submit(copy_object, src, dst, e, progress) for e in todo]
        server_side = sum(bool(f.result()) for f in futures)
    require_present(dst, rest)
    put_manifest(dst, manifest.to_json_bytes(), overwrite=overwrite)
    metadata = manifest.object(METADATA_KEY)
    if metadata is not None:
        copied: list[bool] = []
        after_commit(
            dst,
            f"copying {METADATA_KEY}",
            lambda: copied.append(copy_object(src, dst, metadata, progress)),
        )
        server_side += sum(copied)
    return server_side
