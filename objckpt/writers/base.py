"""The narrow seam between objckpt and a store family: how bytes get onto it.

One :class:`ObjectStore` per store family (S3, GCS, Azure Blob, local disk,
memory, and a generic fsspec fallback), and every access objckpt makes goes
through it: writes and the commit, whole, bounded and ranged reads, listings,
HEADs and deletes. One protocol, so that what a family must do right is stated
(and tested, :mod:`objckpt.testing.conformance`) in one place, as zarr v3's
``Store`` does. Reading needs little per-store code: fsspec's ``cat_ranges``
already does concurrent ranged reads everywhere, and :mod:`objckpt.writers.reads`
evens out how stores answer a range past an object's end (a 416 from S3, GCS and
Azure) or an empty range.

What a family can promise beyond the protocol is said by capability flags (class
attributes, checked by the conformance suite), never by testing its type:
:attr:`ObjectStore.atomic_create`, :attr:`ObjectStore.keeps_crc32c`,
:attr:`ObjectStore.lists_open_uploads`, :attr:`ObjectStore.shared_by_processes` and
:attr:`ObjectStore.server_side_copy`.

Errors: the read and listing methods raise ``FileNotFoundError`` plainly and
otherwise the store's own error, because their callers retry a batch of reads as
one (:func:`objckpt.writers.retry.retry_call` judges the raw error) and then name
what they were reading; writes, HEADs and deletes raise
:class:`~objckpt.errors.StoreError` subclasses named for the object.

Call order during one save, per rank (rank 0 is the coordinator)::

    store = open_store(location, upload_options)  # every rank
    store.preflight(timeout)                      # see below: not every rank, not every save
    up = store.begin(key, size_hint)              # every rank, once per payload object
    up.write(...); ...; fut = up.close()          #   (or up.abort() on any failure)
    fut.result()                                  #   object visible once this returns
    store.put(index_key, ...)                     # the index objects, before the commit
    store.create("manifest.json", ...)            # coordinator, after every rank's objects
    store.put(".metadata", ...)                   # coordinator, once the manifest is ours
    store.close()

Who preflights: in a synchronous save (``dcp.save`` with ``ObjectStoreWriter``) the
coordinator alone, on every save, before planning (every rank would multiply its
requests by the world size; a rank that cannot write fails its first upload, and
nothing is committed). An async checkpointer preflights on every rank, once per
bucket for its lifetime, before its first copy: credentials that cannot write fail
``save()`` before any staging.

``create`` is the only commit primitive and must be atomic and create-only on
the store: it raises :class:`FileExistsError` if the key exists (a 412 answer,
whether or not it names the condition). The caller settles that, and any other
error, by reading the manifest back (a retried PUT can meet its own earlier write
whose response was lost): :mod:`objckpt.format.settle`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, ClassVar

from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem, FSTimeoutError, sync

import objckpt.writers.retry as retry
from objckpt.errors import BucketNotFoundError
from objckpt.options import UploadOptions
from objckpt.writers.body import Part
from objckpt.writers.checksum import BytesLike, crc32c_combine, crc32c_of
from objckpt.writers.deadline import Deadline, bounded_by, current_deadline
from objckpt.writers.location import Location
from objckpt.writers.reads import (
    SpanSink,
    read_bounded,
    read_range,
    read_ranges,
    read_ranges_into,
    read_whole,
)
from objckpt.writers.throttle import Backoff
from objckpt.writers.translate import precondition_failed, translate, unsatisfiable_range

__all__ = [
    "PROBE_KEY",
    "BufferedUpload",
    "ObjectHead",
    "ObjectInfo",
    "ObjectStore",
    "ObjectUpload",
    "OpenUpload",
    "translated_future",
]

logger = logging.getLogger(__name__)


#: Key of the empty multipart upload a preflight begins and aborts to prove write
#: access; no object is ever created under it.
PROBE_KEY = ".objckpt-write-probe"
#: Seconds the preflight's outer wait allows past its bound, so that the retry
#: layer, which knows what the store answered, is the one that reports running out.
PREFLIGHT_GRACE = 5.0


class ObjectUpload(abc.ABC):
    """One object being written. Not thread-safe: one writer thread per upload.

    Attributes:
        tracks_crc32c: True when the upload checksums its bytes itself (to send the
            checksum with its requests); the writer then skips its own object-wide
            pass and reads ``crc32c`` once ``close()`` has been called.
        crc32c: The object's CRC32C (8 hex digits) once closed, when tracked.
    """

    tracks_crc32c = False

    def __init__(self, key: str) -> None:
        self.key = key
        self.crc32c: str | None = None

    @abc.abstractmethod
    def write(self, data: BytesLike) -> int | None:
        """Append bytes. May block while too many parts are in flight (backpressure).

        The bytes are copied or written before this returns, so the caller may
        reuse ``data`` afterwards. Returns the CRC32C of ``data`` when the upload
        computed it anyway (``tracks_crc32c``), so a caller that checksums items
        does not hash the same bytes a second time; None otherwise.
        """

    def write_kept(self, data: BytesLike) -> int | None:
        """:meth:`write` for bytes the caller keeps valid and unchanged until the
        upload is closed and its future resolved (or aborted): a store may send them
        from where they lie instead of copying them (an upload worker's view of a
        staging segment). By default, :meth:`write`."""
        return self.write(data)

    @abc.abstractmethod
    def close(self) -> concurrent.futures.Future[None]:
        """Finish the object; it is visible on the store once the future resolves.

        A failure aborts any multipart upload before the future raises.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Give the object up: abort its multipart upload or delete its partial bytes."""


@dataclasses.dataclass(frozen=True)
class OpenUpload:
    """A multipart upload left open.

    Attributes:
        key: Relative to the store's location.
        last_activity: When it was started or last received a part (seconds
            since the epoch), None if the store does not say.
    """

    key: str
    upload_id: str
    last_activity: float | None


@dataclasses.dataclass(frozen=True)
class ObjectHead:
    """What a HEAD tells of one object, without reading it.

    Attributes:
        size: Bytes.
        tag: What the store changes whenever the bytes change (S3's ETag, GCS's
            generation), None where it has none.
    """

    size: int
    tag: str | None
    modified: float | None = None


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object found by :meth:`ObjectStore.inventory`.

    Attributes:
        key: Path relative to the store's location (``step-0000000100/manifest.json``).
        size: Bytes.
        modified: Last-modified time (seconds since the epoch), None when the
            store does not say (such objects are never collected).
    """

    key: str
    size: int
    modified: float | None


def modified_time(info: Mapping[str, Any]) -> float | None:
    """The last-modified time (seconds since the epoch) in an fsspec ``info``, under
    whichever name the store family gives it; None when it gives none."""
    for name in ("LastModified", "mtime", "updated", "last_modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=datetime.timezone.utc)
            return parsed.timestamp()
    return None


class ObjectStore(abc.ABC):
    """Every access to objects under one checkpoint location (see the module docstring)."""

    #: ``create`` is create-only even against a concurrent writer (a conditional
    #: write on the store, or a lock on one host). False: check-then-write.
    atomic_create: ClassVar[bool] = False
    #: ``digest`` can return the full-object CRC32C the store computed itself (for
    #: objects where it kept one); False: it always returns None.
    keeps_crc32c: ClassVar[bool] = False
    #: ``put`` and ``create`` send the bytes' CRC32C and the store refuses a write
    #: whose bytes differ (S3's ``x-amz-checksum-crc32c``): what was acknowledged is
    #: what was sent, with no read-back. False: only a read-back proves it.
    verifies_writes: ClassVar[bool] = False
    #: ``open_uploads`` lists unfinished multipart uploads (S3); False: an
    #: unfinished upload leaves nothing listable, and ``open_uploads`` is empty.
    lists_open_uploads: ClassVar[bool] = False
    #: Every process of a job, on any node, reaches the same objects under a URL
    #: (an object store). False where a path may be one node's own (local disk) or
    #: one process's (memory).
    shared_by_processes: ClassVar[bool] = True

    def __init__(
        self, location: Location, options: UploadOptions, fs: AbstractFileSystem | None = None
    ) -> None:
        self.location = location
        self.options = options
        self._fs = fs if fs is not None else location.open_fs(fresh=True)
        # Bounds the parts buffered for upload (memory). Requests in flight back off
        # under throttling in the filesystem's own Backoff, per key directory.
        self._slots = threading.Semaphore(options.max_parts_in_flight)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def lists_concurrently(self) -> bool:
        """Several threads may list through this store's client at once: it keeps no
        listing cache (objckpt's default, ``use_listings_cache=False``). With one,
        the invalidation before each listing (a ``pop`` of every parent directory's
        entry, fsspec's ``DirCache``) raises ``KeyError`` where two threads pop the
        same entry; with none, the cache is always empty and nothing races."""
        cache = getattr(self._fs, "dircache", None)
        return cache is None or not getattr(cache, "use_listings_cache", True)

    # -- helpers shared by the families ------------------------------------------------
    @property
    def is_async(self) -> bool:
        return isinstance(self._fs, AsyncFileSystem)

    def submit_coro(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run a coroutine on the filesystem's own event loop thread."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def run_coro(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the filesystem's event loop; past ``timeout`` seconds raise
        the builtin TimeoutError (which translates to StoreUnreachableError)."""
        try:
            return sync(self._fs.loop, lambda: coro, timeout=timeout)
        except FSTimeoutError as exc:
            raise TimeoutError(f"no answer within {timeout} s") from exc

    def submit_call(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        """Run a blocking call on a small thread pool owned by this store."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.options.max_parts_in_flight, thread_name_prefix="objckpt-io"
                )
            return self._pool.submit(fn, *args)

    def acquire_slot(self) -> None:
        """Wait until fewer than ``max_parts_in_flight`` parts are held for upload."""
        self._slots.acquire()

    def release_slot(self, _: object = None) -> None:
        self._slots.release()

    @property
    def backoff(self) -> Backoff | None:
        """The filesystem's throttling back-off (None for a store without one, such
        as ``file://``): what it learned is shared by every store on that client."""
        backoff = getattr(self._fs, "backoff", None)
        return backoff if isinstance(backoff, Backoff) else None

    def path(self, key: str) -> str:
        return self.location.key_path(key)

    def parted_part_size(self, size_hint: int) -> int | None:
        """The part size where an object of about ``size_hint`` bytes goes up in
        parallel parts committed at the end (Azure's blocks, GCS's pieces); None
        where it is buffered and sent in one request: up to twice ``part_size``, the
        option and not the grown part (grown past a short tail, two parts would be
        one buffered request, which the SDKs send in small blocks or chunks, one at
        a time), or where the filesystem is not async."""
        if size_hint > 2 * self.options.part_size and self.is_async:
            return self.options.part_size_for(size_hint)
        return None

    def preflight_bound(self, timeout: float) -> contextlib.AbstractContextManager[Any]:
        """Bound the preflight's requests by ``timeout`` (within the save's deadline),
        in the retry layer: a store that keeps answering 503 then fails with what it
        answered, not with a bare "no answer" when the outer wait runs out
        (``run_coro``'s own timeout is that bound plus :data:`PREFLIGHT_GRACE`)."""
        return bounded_by(
            Deadline.capped(
                current_deadline(), timeout, f"checking {self.location.url}", "preflight_timeout"
            )
        )

    def pipe_create(
        self,
        key: str,
        data: bytes,
        *,
        overwrite: bool,
        exists: Callable[[BaseException], bool] = precondition_failed,
    ) -> None:
        """One write through the filesystem's ``pipe_file(mode="create")`` (gcsfs sends
        ``ifGenerationMatch=0``, adlfs ``If-None-Match: *``), or ``mode="overwrite"``.

        Args:
            exists: Whether a failure is the store saying the object exists (a 412
                by default; Azure's 409 ``BlobAlreadyExists``), for answers the
                filesystem did not already turn into ``FileExistsError``.

        Raises:
            FileExistsError: The object exists and ``overwrite`` is False.
        """
        try:
            self._fs.pipe_file(self.path(key), data, mode="overwrite" if overwrite else "create")
        except FileExistsError:
            raise
        except Exception as exc:
            if not overwrite and exists(exc):
                raise FileExistsError(self.location.url_of(key)) from exc
            raise translate(exc, url=self.location.url_of(key), action="committing") from exc
        finally:
            self._fs.invalidate_cache(self.path(key))

    # -- the protocol ------------------------------------------------------------------
    def preflight(self, timeout: float) -> None:
        """Fail fast, in bounded time, if the location cannot be written.

        The default checks that the parent of the checkpoint prefix is reachable.

        Raises:
            BucketNotFoundError, AccessDeniedError, MissingCredentialsError,
            StoreUnreachableError: named for the URL.
        """
        bucket = self.location.bucket
        try:
            if self.is_async:
                with self.preflight_bound(timeout):
                    coro = self._fs._exists(bucket)
                    exists = self.run_coro(coro, timeout=timeout + PREFLIGHT_GRACE)
            else:
                exists = self.submit_call(self._fs.exists, bucket).result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise translate(
                TimeoutError(f"no answer within {timeout} s"),
                url=self.location.url,
                action="checking",
            ) from exc
        except Exception as exc:
            raise translate(
                exc, url=self.location.url, action="checking", missing_is_bucket=True
            ) from exc
        if not exists:
            raise BucketNotFoundError(f"bucket {bucket!r} of {self.location.url} does not exist")

    @abc.abstractmethod
    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        """Start writing the object ``key`` of about ``size_hint`` bytes."""

    def put(self, key: str, data: bytes | bytearray) -> None:
        """Write a small object in one request (overwriting is allowed); ``data`` may be
        a ``bytearray`` (the commit helper's ``.metadata``, built in place). fsspec's
        ``pipe_file`` takes bytes (adlfs fails on a ``bytearray``): copied here, not by
        the stores that write it themselves (S3, local)."""
        try:
            self._fs.pipe_file(self.path(key), bytes(data))
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="writing") from exc

    @abc.abstractmethod
    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        """Write ``key`` only if it does not exist, atomically (the commit).

        Args:
            overwrite: Replace an existing object instead (still one atomic write).

        Raises:
            FileExistsError: ``key`` exists and ``overwrite`` is False.
            StoreError: Any other failure.
        """

    def read(self, key: str) -> bytes:
        """The whole object. Raises FileNotFoundError (plain) when it is absent."""
        try:
            return bytes(
                retry.retry_call(
                    lambda: read_whole(self._fs, self.path(key)),
                    self.location.retry,
                    f"reading {self.location.url_of(key)}",
                    self._fs,
                )
            )
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="reading") from exc

    def read_bounded(self, key: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``key`` in one ranged GET: a longer answer
        says the object is over ``limit`` without reading it whole.

        Raises:
            FileNotFoundError: No such object.
            Exception: The store's own error (see the module docstring).
        """
        return read_bounded(self._fs, self.path(key), limit)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``, fewer where it ends sooner (none where
        it ends at or before ``start``); no request for an empty range.

        Raises:
            FileNotFoundError: No such object.
            Exception: The store's own error (see the module docstring).
        """
        return read_range(self._fs, self.path(key), start, end)

    def read_ranges(
        self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes | BaseException]:
        """:meth:`read_range` of each ``(key, start, end)``, concurrently where the
        client can; a failed range's exception takes its place in the answer."""
        return read_ranges(self._fs, [self.path(k) for k in keys], starts, ends)

    def read_ranges_into(
        self,
        keys: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        sinks: Sequence[SpanSink],
    ) -> list[int | BaseException]:
        """:meth:`read_ranges` written into ``sinks`` (one per range, each as long
        as its range): how many bytes each answer had (a longer answer is counted,
        not written past its sink), or the range's exception in its place. Clients
        objckpt builds for S3, GCS and Azure (``cat_ranges_into``) write each received
        chunk once, where it belongs; others answer whole and are copied in."""
        paths = [self.path(k) for k in keys]
        into = getattr(self._fs, "cat_ranges_into", None)
        if into is None:
            return read_ranges_into(self._fs, paths, starts, ends, sinks)
        out = into(paths, list(starts), list(ends), list(sinks))
        return [0 if isinstance(o, BaseException) and unsatisfiable_range(o) else o for o in out]

    @contextlib.contextmanager
    def open_read(self, key: str, block_size: int) -> Iterator[IO[bytes]]:
        """``key`` as a file read front to back in ``block_size`` requests (an object
        too large to hold whole). Errors as :meth:`read_range`."""
        with self._fs.open(self.path(key), "rb", block_size=block_size) as f:
            yield f

    def at(self, location: Location) -> ObjectStore:
        """A store of the same family, options and client for another location of
        the same service (a sibling step, a root above this one): no new client, no
        new connections."""
        if location.protocol != self.location.protocol:
            raise ValueError(f"{location.url} is not on {self.location.url}'s service")
        return type(self)(location, self.options, self._fs)

    def child(self, name: str) -> ObjectStore:
        """:meth:`at` the sub-prefix ``name`` of this location (a ``step-N``)."""
        return self.at(self.location.child(name))

    def retrying(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn`` (a whole read of this store: a batch of ranges, one manifest) under
        the location's retry policy, in the store's one retry layer
        (:func:`objckpt.writers.retry.retry_call`)."""
        return retry.retry_call(fn, self.location.retry, what, self._fs)

    def forget_listings(self) -> None:
        """Drop what the client remembers of listings under this location: the next
        listing or HEAD asks the store."""
        self._fs.invalidate_cache(self.location.path)

    def inventory(self) -> list[ObjectInfo]:
        """Every object under the location (one recursive listing, paginated by the
        store), sorted by key.

        An empty answer from an object store is checked once more: a root in a
        bucket that does not exist must not look like a root without steps (a typo
        in the bucket name would otherwise read as "nothing saved yet").

        Raises:
            BucketNotFoundError: The bucket does not exist (object stores only; a
                missing local directory is an empty root).
            StoreError: The listing failed (translated, naming the location).
        """
        root = self.location
        found = self._listed(self._fs.find, {})
        if not found:
            return []
        prefix = root.path.rstrip("/") + "/"
        out = []
        for path, info in found.items():
            path = str(path)
            if info.get("type") == "directory":
                continue
            if not path.startswith(prefix):
                path = "/" + path if ("/" + path).startswith(prefix) else path
            key = path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
            out.append(ObjectInfo(key, int(info.get("size") or 0), modified_time(info)))
        return sorted(out, key=lambda o: o.key)

    def directories(self) -> list[str]:
        """Names of the sub-prefixes directly under the location (one listing of its
        top level, not of what they hold).

        Raises:
            BucketNotFoundError: The listing was empty and the bucket does not exist.
            StoreError: The listing failed (translated, naming the location).
        """
        listed = self._listed(self._fs.ls, [])
        return [
            str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            for e in listed
            if e.get("type") == "directory"
        ]

    def _listed(self, how: Callable[..., Any], empty: Any) -> Any:
        """``how`` (the client's ``find`` or ``ls``) of the location afresh, with
        details; ``empty`` where nothing is there, once :meth:`require_bucket` has
        said the bucket exists (an empty answer must not hide a misspelt bucket).

        Raises:
            BucketNotFoundError: Nothing listed and the bucket does not exist.
            StoreError: The listing failed (translated, naming the location).
        """
        root = self.location
        self._fs.invalidate_cache(root.path)
        try:
            found = how(root.path, detail=True)
        except FileNotFoundError:
            found = empty
        except Exception as exc:
            raise translate(exc, url=root.url, action="listing", missing_is_bucket=True) from exc
        if not found:
            self.require_bucket()
            return empty
        return found

    def require_bucket(self) -> None:
        """Raise when the location's bucket does not exist (one request; object
        stores only).

        Raises:
            BucketNotFoundError: Named for the bucket and the location.
            StoreError: The check itself failed (translated, naming the location).
        """
        root = self.location
        if root.is_local:
            return
        try:
            exists = self._fs.exists(root.bucket)
        except Exception as exc:
            raise translate(exc, url=root.url, action="listing", missing_is_bucket=True) from exc
        if not exists:
            raise BucketNotFoundError(f"bucket {root.bucket!r} of {root.url} does not exist")

    def remove_empty_directories(self, inner: Iterable[str] = ()) -> None:
        """On local disk, remove the sub-directories ``inner`` and then the
        location's own directory, each only if empty (object stores have no
        directories: nothing to do). A directory that is not empty, or already
        gone, stays as it is."""
        if not self.location.is_local:
            return
        path = self.location.path
        for name in inner:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(path, name))
        with contextlib.suppress(OSError):
            os.rmdir(path)

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Size by name of each entry directly under the location (or its
        ``prefix`` sub-prefix), afresh: empty if there is none. One request answers
        what is here and how large each object is; a sub-prefix is listed by its
        name (its size is 0).

        Raises:
            Exception: The store's own error (see the module docstring).
        """
        path = self.location.key_path(prefix) if prefix else self.location.path
        self._fs.invalidate_cache(path)
        try:
            entries = self._fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
        }

    def head(self, key: str) -> ObjectHead:
        """``key``'s size and version tag, afresh (one HEAD; no payload read).

        Raises:
            FileNotFoundError: The object is absent.
            StoreError: Any other failure, named for the object.
        """
        info = self.fresh_info(key)
        if info.get("type") == "directory":  # a prefix (or local directory), no object
            raise FileNotFoundError(self.location.url_of(key))
        tag = info.get("ETag") or info.get("etag") or info.get("generation")
        return ObjectHead(
            int(info.get("size") or 0), str(tag) if tag else None, modified_time(info)
        )

    def fresh_info(self, key: str) -> dict[str, Any]:
        """fsspec's ``info`` of ``key`` past its listing cache (a HEAD's answer): what
        :meth:`head` and a family's :meth:`digest` read their fields from.

        Raises:
            FileNotFoundError: The object is absent.
            StoreError: Any other failure, named for the object.
        """
        try:
            self._fs.invalidate_cache(self.path(key))
            return dict(self._fs.info(self.path(key)))
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="checking") from exc

    def exists(self, key: str) -> bool:
        try:
            self._fs.invalidate_cache(self.path(key))
            return bool(self._fs.exists(self.path(key)))
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="checking") from exc

    def same_service(self, other: ObjectStore) -> bool:
        """Whether one client of this store can also read ``other``'s objects:
        the same store family with the same options (endpoint, credentials)."""
        return type(other) is type(self) and dict(other.location.storage_options) == dict(
            self.location.storage_options
        )

    #: Whether :meth:`_copy_inside` is implemented (a provider-side copy exists).
    server_side_copy = False

    def copy_from(self, src: ObjectStore, key: str, size: int) -> bool:
        """Copy ``src``'s object ``key`` to the same key here inside the provider.

        Returns False, having done nothing, where no server-side copy applies (a
        different provider or account, or a store without one); the caller then
        streams the bytes. The copy is unverified: check it with :meth:`digest`.
        """
        if not self.server_side_copy or not self.same_service(src):
            return False
        try:
            self._copy_inside(src, key, size)
        except Exception as exc:
            raise translate(
                exc, url=self.location.url_of(key), action=f"copying {src.location.url_of(key)}"
            ) from exc
        finally:
            self._fs.invalidate_cache(self.path(key))
        return True

    def _copy_inside(self, src: ObjectStore, key: str, size: int) -> None:
        """The provider-side copy of a store with ``server_side_copy``."""
        raise NotImplementedError

    def digest(self, key: str) -> tuple[int, str | None]:
        """The object's size and the full-object CRC32C the store keeps for it
        (8 hex digits), or None where the store keeps none. Reads no payload.

        Raises:
            FileNotFoundError: The object is absent.
        """
        try:
            info = self._fs.info(self.path(key))
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="checking") from exc
        return int(info.get("size") or 0), None

    def delete(self, key: str) -> None:
        """Remove one object (absent is fine)."""
        try:
            self._fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="deleting") from exc

    def remove_aborted(self, key: str) -> None:
        """Best effort :meth:`delete` of an object an aborted upload may have made:
        one left behind is named by no manifest, garbage for ``objckpt gc``."""
        try:
            self.delete(key)
        except Exception:
            logger.debug("could not remove aborted object %s", key, exc_info=True)

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove objects in batched requests where the store has them (absent ones
        are fine).

        Raises:
            StoreError: A deletion failed, named for the first object of its batch.
        """
        batch = 500
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            try:
                self._fs.rm([self.path(k) for k in chunk])
            except FileNotFoundError:
                for k in chunk:  # some were gone already: delete the rest one by one
                    with contextlib.suppress(FileNotFoundError):
                        self._fs.rm(self.path(k))
            except Exception as exc:
                raise translate(exc, url=self.location.url_of(chunk[0]), action="deleting") from exc
        self._fs.invalidate_cache(self.location.path)

    def open_uploads(self) -> list[OpenUpload]:
        """Multipart uploads started under this location and never completed.

        Only stores that can list them say anything (S3); elsewhere an
        unfinished upload leaves nothing behind or nothing listable.
        """
        return []

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one open multipart upload (frees the parts it holds)."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads to abort")

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class PartedUpload(ObjectUpload):
    """An upload that cuts its bytes into parts of ``part_size`` and hands each to
    :meth:`_part_full` as it fills: the write side of every store whose large objects
    are parts (S3's multipart, Azure's staged blocks, GCS's composed pieces).

    Each byte is hashed once: the CRC32C of a part and of a write (returned) are
    built from the same pieces, and a subclass combines the parts' into the object's.
    """

    tracks_crc32c = True

    def __init__(self, key: str, part_size: int) -> None:
        super().__init__(key)
        self._part_size = part_size
        self._part = Part()

    def write(self, data: BytesLike) -> int:
        """Copy ``data`` into the part (the caller may reuse its buffer)."""
        return self._add(data, copy=True)

    def write_kept(self, data: BytesLike) -> int:
        """As :meth:`write`, but the part refers to ``data`` where it lies (no copy)."""
        return self._add(data, copy=False)

    def _add(self, data: BytesLike, *, copy: bool) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        pos, total = 0, len(view)
        crc = 0
        while pos < total:
            take = min(total - pos, self._part_size - self._part.size)
            piece = view[pos : pos + take]
            piece_crc = crc32c_of(piece)
            self._part.add(piece, piece_crc, copy=copy)
            crc = crc32c_combine(crc, piece_crc, take) if pos else piece_crc
            pos += take
            if self._part.size == self._part_size:
                self._part_full(self._take_part())
        return crc

    def _take_part(self) -> Part:
        """The part written so far (a whole one, or the last), a new one begun."""
        part, self._part = self._part, Part()
        return part

    @abc.abstractmethod
    def _part_full(self, part: Part) -> None:
        """A part of ``part_size`` bytes was written: send it (or hold it)."""


class BufferedUpload(ObjectUpload):
    """Collects the object in memory and writes it in one call on close.

    Used for Azure's objects of up to two parts (one Put Blob), and by stores
    without an upload of their own in objckpt (memory, any fsspec store). Memory use
    is the object's size.
    """

    def __init__(self, store: ObjectStore, key: str, size_hint: int) -> None:
        super().__init__(key)
        self._store = store
        self._buf = bytearray()
        self._closed = False

    def write(self, data: BytesLike) -> None:
        self._buf += data

    def close(self) -> concurrent.futures.Future[None]:
        self._closed = True
        # ``bytes``, never the bytearray: azure-storage-blob iterates a bytearray
        # as ints ("can't concat int to bytes"), and no backend may see the buffer
        # change under it. The buffer goes at once, so the copy is the one held.
        data, self._buf = bytes(self._buf), bytearray()
        store, path = self._store, self._store.path(self.key)
        store.acquire_slot()
        fut: concurrent.futures.Future[None]
        if store.is_async:
            fut = store.submit_coro(store._fs._pipe_file(path, data))
        else:
            fut = store.submit_call(store._fs.pipe_file, path, data)
        fut.add_done_callback(store.release_slot)
        return translated_future(fut, store.location.url_of(self.key), "uploading")

    def abort(self) -> None:
        self._buf = bytearray()
        if self._closed:
            self._store.remove_aborted(self.key)


def translated_future(
    fut: concurrent.futures.Future[Any], url: str, action: str
) -> concurrent.futures.Future[None]:
    """A future that fails with an objckpt error when ``fut`` fails."""
    out: concurrent.futures.Future[None] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        exc = f.exception()
        if exc is None:
            out.set_result(None)
        else:
            err = translate(exc, url=url, action=action)
            err.__cause__ = exc
            out.set_exception(err)

    fut.add_done_callback(done)
    return out
