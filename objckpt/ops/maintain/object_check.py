"""One object checked, or copied, against its manifest entry.

The pieces ``verify``, ``cp``, backups and promotion share
(:mod:`objckpt.ops.maintain.verify` puts them together): stream an object computing
its CRC32C, check a copy by the store's own full-object CRC32C where it keeps one,
copy one object checked on the way. An object a step references in a sibling step
directory (``../step-<N>/<key>``, :mod:`objckpt.format.refs`) is read and written
where it is stored: the store's paths resolve the reference
(:meth:`objckpt.writers.location.Location.key_path`).

What a promotion worker runs (:func:`promote_object`) is here too: this module never
imports torch, so neither does the worker interpreter that unpickles that function
(``tests/pipeline/test_workers.py::test_promotion_workers_never_import_torch``
holds it to that).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from objckpt.errors import ChecksumMismatchError, SizeMismatchError
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import ObjectEntry
from objckpt.format.ref_check import stored_where
from objckpt.ops.maintain.referenced import Siblings
from objckpt.options import UploadOptions
from objckpt.pipeline.upload_task import worker_store
from objckpt.writers import ObjectStore
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = [
    "ObjectCheck",
    "Progress",
    "copy_object",
    "holds_reference",
    "promote_object",
    "stream_object",
]

_CHUNK = 8 * 1024 * 1024
Progress = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class ObjectCheck:
    """One object's check. ``problem`` is None when size and CRC32C match.

    ``key`` is the manifest's key (a reference ``../step-<N>/<key>`` for an object
    another step stores); ``stored_at`` the URL it was read from ("" when not
    recorded).
    """

    key: str
    size: int
    crc32c: str
    actual_size: int | None
    actual_crc32c: str | None
    problem: str | None
    stored_at: str = ""


def stream_object(
    store: ObjectStore, key: str, sink: Callable[[bytes], object], progress: Progress | None
) -> tuple[int, str]:
    """Read one object in chunks; returns (size, crc32c)."""
    crc = Crc32c()
    size = 0
    try:
        with store.open_read(key, _CHUNK) as f:
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


def check_object(
    store: ObjectStore,
    entry: ObjectEntry,
    progress: Progress | None,
    siblings: Siblings | None = None,
) -> ObjectCheck:
    """Read one object and compare it with its manifest entry; a referenced object
    is read where it is stored (``siblings``), and a problem with it names both steps."""
    where, key = siblings.resolve(entry.key) if siblings is not None else (store, entry.key)
    url = where.location.url_of(key)
    both = stored_where(store.location, entry.key)

    def problem(msg: str, size: int | None = None, crc: str | None = None) -> ObjectCheck:
        return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, msg + both, url)

    try:
        size, crc = stream_object(where, key, lambda _: None, progress)
    except FileNotFoundError:
        return problem("missing")
    if size != entry.size:
        return problem(f"size {size} != {entry.size} in the manifest", size, crc)
    if crc != entry.crc32c:
        return problem(f"CRC32C {crc} != {entry.crc32c} in the manifest", size, crc)
    return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, None, url)


def digest_check(
    dst: ObjectStore, entry: ObjectEntry, progress: Progress | None, *, source: str
) -> ObjectCheck:
    """Check ``dst``'s copy of ``entry``: the store's own full-object CRC32C when
    it keeps one (no payload read), else read the object back (a family that never
    keeps one is read back at once: no HEAD that could only answer "no CRC32C")."""
    if not dst.keeps_crc32c:
        return check_object(dst, entry, progress)
    try:
        size, crc = dst.digest(entry.key)
    except FileNotFoundError:
        return ObjectCheck(entry.key, entry.size, entry.crc32c, None, None, "missing")
    if crc is None:
        return check_object(dst, entry, progress)
    if progress is not None:
        progress(entry.size)
    problem = None
    if size != entry.size:
        problem = f"size {size} != {entry.size} in the manifest of {source}"
    elif crc != entry.crc32c:
        problem = f"CRC32C {crc} != {entry.crc32c} in the manifest of {source}"
    return ObjectCheck(entry.key, entry.size, entry.crc32c, size, crc, problem)


def copy_object(
    src: ObjectStore,
    dst: ObjectStore,
    entry: ObjectEntry,
    progress: Progress | None,
    *,
    fresh: bool = False,
) -> bool:
    """Copy one object, checked against the manifest; True when copied server-side.

    Args:
        fresh: The caller checked that ``dst`` did not hold the key before: a
            server-side copy that fails its check is deleted again. Otherwise it is
            left for ``gc`` (an object that was there may be one a committed step
            references).
    """
    if dst.copy_from(src, entry.key, entry.size):
        check = digest_check(dst, entry, progress, source=src.location.url)
        if check.problem is not None:
            if fresh:  # never committed; gc removes it otherwise
                with contextlib.suppress(Exception):
                    dst.delete(entry.key)
            cls = SizeMismatchError if check.problem.startswith("size") else ChecksumMismatchError
            raise cls(f"server-side copy of {src.location.url_of(entry.key)}: {check.problem}")
        return True
    if entry.key == METADATA_KEY:  # small; written after the commit (replaced on an overwrite)
        chunks: list[bytes] = []
        size, crc = stream_object(src, entry.key, chunks.append, progress)
        _check_copy(src, entry, size, crc)
        dst.put(entry.key, b"".join(chunks))
        return False
    upload = dst.begin(entry.key, entry.size)
    try:
        size, crc = stream_object(src, entry.key, upload.write, progress)
        _check_copy(src, entry, size, crc)
        upload.close().result()
    except BaseException:
        upload.abort()
        raise
    return False


def promote_object(
    src: Location, dst: Location, options: UploadOptions, entry: ObjectEntry
) -> RequestStats:
    """Worker side of a promotion (:mod:`objckpt.ops.tier.promote`): copy one object
    from the local tier to the primary, checked against ``entry`` while it streams
    (a damaged local copy is never committed). Returns the requests it cost."""
    with counting(RequestCounter()) as counter:
        copy_object(worker_store(src, options), worker_store(dst, options), entry, None)
    return counter.snapshot()


def _check_copy(src: ObjectStore, entry: ObjectEntry, size: int, crc: str) -> None:
    where = src.location.url_of(entry.key)
    if size != entry.size:
        raise SizeMismatchError(f"{where} is {size} bytes, the manifest says {entry.size}")
    if crc != entry.crc32c:
        raise ChecksumMismatchError(f"{where} has CRC32C {crc}, the manifest says {entry.crc32c}")


def holds_reference(dst: ObjectStore, entry: ObjectEntry) -> bool:
    """Whether ``dst`` holds the object ``entry`` (the step's own, or one it
    references) already: its full-object CRC32C where the store keeps one, else the
    bytes read back.

    Raises:
        SizeMismatchError, ChecksumMismatchError: Something else is stored there (it
            is never overwritten: an object under a step directory may be a committed
            step's).
    """
    check = digest_check(dst, entry, None, source="the source step")
    if check.problem is None:
        return True
    if check.problem == "missing":
        return False
    cls = SizeMismatchError if check.problem.startswith("size") else ChecksumMismatchError
    raise cls(
        f"{dst.location.url_of(entry.key)}, which the copy to {dst.location.url} would "
        f"write, already holds other bytes: {check.problem}; it is never overwritten "
        "(a committed step may reference it: delete it, or copy to another root)"
    )
