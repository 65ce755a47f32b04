"""GCS uploads: one streamed request for an object of up to two parts
(:class:`MediaUpload`), parallel composite uploads above (:class:`CompositeUpload`).

Both send bytes where they lie
(:meth:`~objckpt.writers.gcsclient.RetryingGCSFileSystem._put_streamed`), and both
check the object GCS made against the CRC32C objckpt computed while the bytes were
written: a single request's from GCS's answer to it, a composite's from a read of its
metadata after ``compose``.

Composite uploads: parts as temporary objects, then ``compose``.

Why: a GCS object uploaded in one request is one stream, and a resumable upload
takes its chunks strictly in order, so neither puts several connections to work
on one large object. GCS's answer (what ``gcloud storage`` calls parallel
composite uploads) is to upload pieces as objects of their own, concurrently,
and ``compose`` them into the final object server-side (at most 32 sources per
call; more are composed in a tree). GCS computes the composite's CRC32C (it
keeps no MD5 for composites), which objckpt compares with the CRC32C it
computed while the bytes went by, so a piece lost or reordered never yields an
object the manifest vouches for. Temporary pieces are deleted once composed; a
crash leaves them as unreferenced objects ``objckpt gc`` removes.

Pieces go up under the store's request limit (``UploadOptions.max_parts_in_flight``,
halved under 429/503 by the AIMD limit like S3's parts), so the memory held is
bounded by ``max_parts_in_flight * part_size``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from typing import TYPE_CHECKING

from objckpt.errors import ChecksumMismatchError
from objckpt.writers.base import PartedUpload, translated_future
from objckpt.writers.body import Part
from objckpt.writers.checksum import crc32c_combine, crc_from_base64, format_crc
from objckpt.writers.translate import translate

if TYPE_CHECKING:
    from objckpt.writers.generic import GcsStore

__all__ = [
    "COMPOSE_LIMIT",
    "PIECE_MARK",
    "CompositeUpload",
    "MediaUpload",
    "piece_key",
    "piece_owner",
]

logger = logging.getLogger(__name__)

#: Source objects one GCS compose request accepts.
COMPOSE_LIMIT = 32
#: What follows an object's key in the names of its temporary pieces.
PIECE_MARK = ".objckpt-piece-"
_PIECE = re.compile(rf"(.+){re.escape(PIECE_MARK)}\d+-\d+", re.DOTALL)  # fullmatch: no $


def piece_key(key: str, level: int, index: int) -> str:
    """The temporary object of piece ``index`` (level 0) or of an intermediate
    composite (level > 0) of ``key``."""
    return f"{key}{PIECE_MARK}{level}-{index:05d}"


def piece_owner(name: str) -> str | None:
    """The key whose temporary piece ``name`` is (the inverse of :func:`piece_key`).

    Pieces are named here, by the upload that makes them, whoever the caller; a
    layer that finds one left on the store (a crash leftover) asks this function
    whose it is instead of parsing the name itself.

    Returns:
        The owner's key, or None when ``name`` is not a piece's name.
    """
    match = _PIECE.fullmatch(name)
    return match.group(1) if match else None


class MediaUpload(PartedUpload):
    """An object of up to two parts: held as written (a ``write_kept``'s bytes where
    they lie) and sent in one streamed request on close. GCS answers with the object
    it made; an object whose size, or CRC32C where the answer has one, is not what was
    written is deleted and fails the upload
    (:class:`~objckpt.errors.ChecksumMismatchError`): no request more than the upload
    itself while nothing is damaged, where gcsfs's upload checked nothing.

    An object that outgrows its size hint (a writer that cannot know its size begins
    with 0) is handed to a :class:`CompositeUpload` when a third part fills, the two
    held parts first: no object larger than two parts goes in one request, and the
    memory held stays bounded as a composite upload's is."""

    def __init__(self, store: GcsStore, key: str, part_size: int) -> None:
        super().__init__(key, part_size)
        self._store = store
        self._parts: list[Part] = []
        self._composite: CompositeUpload | None = None
        self._sent: concurrent.futures.Future[None] | None = None
        self._closed = False

    def _part_full(self, part: Part) -> None:
        if self._composite is None and len(self._parts) < 2:
            self._parts.append(part)  # all of it goes in one request, on close
            return
        if self._composite is None:
            self._composite = CompositeUpload(self._store, self.key, self._part_size)
            held, self._parts = self._parts, []
            for earlier in held:
                self._composite._part_full(earlier)
        self._composite._part_full(part)

    def close(self) -> concurrent.futures.Future[None]:
        if self._composite is not None:
            last = self._take_part()
            if last.size:
                self._composite._part_full(last)
            done = self._composite.close()
            self.crc32c = self._composite.crc32c
            return done
        body, self._parts = sum((*self._parts, self._take_part()), Part()), []
        self.crc32c = format_crc(body.crc)
        store = self._store
        store.acquire_slot()
        self._closed = True  # from here an object may be made
        self._sent = store.submit_coro(self._send(body))
        self._sent.add_done_callback(store.release_slot)
        return translated_future(self._sent, store.location.url_of(self.key), "uploading")

    async def _send(self, body: Part) -> None:
        fs, path = self._store._fs, self._store.path(self.key)
        made = await fs._put_streamed(path, body.pieces, body.size)
        size, crc = int(made.get("size", body.size)), made.get("crc32c")
        if size != body.size or (crc and crc_from_base64(crc) != self.crc32c):
            url = self._store.location.url_of(self.key)
            try:  # the damaged object goes at once, not at the caller's abort (if any)
                await fs._rm_file(path)
            except Exception:  # best effort: an uncommitted object is garbage for gc anyway
                logger.debug("could not remove damaged object %s", self.key, exc_info=True)
            raise ChecksumMismatchError(
                f"{url}: GCS made an object of {size} bytes with CRC32C "
                f"{crc_from_base64(crc) if crc else None}; {body.size} bytes with CRC32C "
                f"{self.crc32c} were sent"
            )

    def abort(self) -> None:
        self._take_part()
        self._parts = []
        if self._composite is not None:
            self._composite.abort()
            return
        if self._sent is not None:
            self._sent.exception()  # the send ends first: its object would land after
        if self._closed:  # sent, maybe made (a damaged one, or an answer lost)
            self._store.remove_aborted(self.key)


class CompositeUpload(PartedUpload):
    """One large GCS object, uploaded as concurrent pieces and composed on close."""

    def __init__(self, store: GcsStore, key: str, part_size: int) -> None:
        super().__init__(key, part_size)
        self._store = store
        self._pieces: list[str] = []
        self._sizes: list[int] = []
        self._futures: list[concurrent.futures.Future[None]] = []
        self._temporary: list[str] = []  # every temporary object made so far
        self._lock = threading.Lock()
        self._closed = False
        self._crc = 0  # of the pieces so far, combined

    def _part_full(self, part: Part) -> None:
        self._crc = crc32c_combine(self._crc, part.crc, part.size)
        key = piece_key(self.key, 0, len(self._pieces))
        self._pieces.append(key)
        self._sizes.append(part.size)
        with self._lock:
            self._temporary.append(key)
        store = self._store
        store.acquire_slot()  # backpressure: at most max_parts_in_flight pieces in memory
        fut = store.submit_coro(store._fs._put_streamed(store.path(key), part.pieces, part.size))
        fut.add_done_callback(store.release_slot)
        self._futures.append(translated_future(fut, store.location.url_of(key), "uploading"))

    def close(self) -> concurrent.futures.Future[None]:
        self._closed = True
        if self._part.size or not self._pieces:
            self._part_full(self._take_part())
        self.crc32c = format_crc(self._crc)
        return self._store.submit_call(self._finish)

    def _finish(self) -> None:
        try:
            for fut in self._futures:
                fut.result()
            self._compose()
            self._check()
        except BaseException:
            self.abort()
            raise
        self._delete(self._temporary)

    def _compose(self) -> None:
        """Compose the pieces into the object, through intermediate composites of
        at most 32 sources while there are more than 32."""
        sources, level = list(self._pieces), 0
        while len(sources) > COMPOSE_LIMIT:
            level += 1
            groups = [sources[i : i + COMPOSE_LIMIT] for i in range(0, len(sources), COMPOSE_LIMIT)]
            names = [piece_key(self.key, level, n) for n in range(len(groups))]
            with self._lock:
                self._temporary += names
            futures = [
                self._store.submit_coro(self._merge(name, group))
                for name, group in zip(names, groups, strict=True)
            ]
            for f in futures:
                f.result()
            sources = names
        self._store.submit_coro(self._merge(self.key, sources)).result()

    async def _merge(self, key: str, sources: list[str]) -> None:
        store = self._store
        try:
            await store._fs._merge(store.path(key), [store.path(s) for s in sources])
        except Exception as exc:
            raise translate(exc, url=store.location.url_of(key), action="composing") from exc

    def _check(self) -> None:
        size, crc = self._store.digest(self.key)
        want = sum(self._sizes)
        url = self._store.location.url_of(self.key)
        if size != want or (crc is not None and crc != self.crc32c):
            raise ChecksumMismatchError(
                f"{url}: the composed object has {size} bytes and CRC32C {crc}; "
                f"{want} bytes with CRC32C {self.crc32c} were uploaded in "
                f"{len(self._pieces)} pieces"
            )

    def _delete(self, keys: list[str]) -> None:
        """Best effort: a temporary object left behind is garbage for ``objckpt gc``."""
        if not keys:
            return
        store = self._store
        try:
            store._fs.rm([store.path(k) for k in keys])
        except Exception:
            logger.debug("could not delete the pieces of %s", self.key, exc_info=True)

    def abort(self) -> None:
        self._take_part()
        for fut in self._futures:  # pieces still uploading would otherwise land later
            fut.exception()
        with self._lock:
            doomed = list(self._temporary)
        self._delete(doomed)
        if self._closed:  # a composed object that failed its check
            self._delete([self.key])
