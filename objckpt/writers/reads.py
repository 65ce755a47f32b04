"""How bytes come off a store: whole objects, bounded reads and byte ranges.

Every read objckpt makes of an object it did not just write goes through here
(manifests, index objects, ``.metadata``, payload ranges, safetensors headers and
tensors), so that one rule holds for every store family: a range reads as a slice
of a local file does, ``data[start:end]``, empty where ``start`` is at or past the
object's end.

Why a module of its own: stores and their clients disagree about exactly those
edges. A ranged GET that starts at or past an object's end is unsatisfiable (RFC
9110): AWS S3, Ceph RGW, MinIO, GCS and Azure (Azurite too) answer 416
``InvalidRange``, and every range of an empty object is such a range. The clients
surface that differently: s3fs as ``OSError(EINVAL)`` carrying whatever text the
store put in its ``Message`` (RGW puts none, so a test on the text failed there),
gcsfs as an ``HttpError`` with code 416, adlfs as azure-core's
``HttpResponseError`` with status 416. A zero-length range cannot be expressed at
all: s3fs sends ``bytes=5-4``, which S3 ignores as malformed and answers with the
whole object, and the Azure SDK raises ``ValueError`` on the answer. Here a 416 reads
as empty (:func:`~objckpt.writers.translate.unsatisfiable_range`, judged by code
and status) and an empty range is answered without a request; callers compare
what they got with what the manifest recorded, so an object shorter than recorded
(or emptied) is a ``SizeMismatchError`` naming it, never a store error.

A load's payload ranges are read *into* memory the caller gives
(:class:`SpanSink`: a range's bytes laid over scratch and the destination tensors'
own memory), not returned as ``bytes``: every copy of a payload costs ~0.1 to 0.2
CPU-s per GiB, page faults of fresh buffers included, and a returned body was
copied three times before it reached a tensor (the HTTP client joining its chunks,
the pieces of a range joined, the copy into the tensor). On S3 a range of a MiB
or more is received straight into that memory (:mod:`objckpt.writers.s3_direct`)
and a shorter one streamed, each received chunk copied once to where it belongs
(:func:`receive_into`); GCS's ranges are streamed the same way, and Azure's written
in chunk by chunk as azure-storage-blob downloads them (its ``readinto`` to a
:class:`SinkFile`; the SDK joins each chunk's pieces first, so two copies where
there were three); any other fsspec store answers whole and the answer is copied
in (:func:`read_ranges_into`).
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Sequence
from typing import Any

from fsspec import AbstractFileSystem

from objckpt.writers.translate import unsatisfiable_range

__all__ = [
    "SinkFile",
    "SpanSink",
    "read_bounded",
    "read_range",
    "read_ranges",
    "read_ranges_into",
    "read_whole",
    "receive_into",
]


def read_whole(fs: AbstractFileSystem, path: str) -> bytes:
    """A small object (manifest, ``.metadata``) in one GET.

    s3fs's ``cat_file`` first HEADs the object to decide whether to split it into
    parallel ranges. For a small object that is a wasted round trip, and a HEAD's
    403 has no body, so a refused key and a wrong secret both read "Forbidden";
    the GET's answer says which (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``).
    An unranged GET of an empty object is an empty 200 everywhere.
    """
    inner = getattr(fs, "_cat_file", None)  # async filesystems only
    if inner is not None and "max_concurrency" in inspect.signature(inner).parameters:
        return bytes(fs.cat_file(path, max_concurrency=1))
    return bytes(fs.cat_file(path))


def read_bounded(fs: AbstractFileSystem, path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of an object, in one ranged GET: a longer answer
    means the object is over ``limit``, found without reading it whole (and without
    a HEAD, whose bodiless 403 would hide which credential was refused). An empty
    object reads as empty.

    Raises:
        FileNotFoundError: No such object.
        Exception: The store's own error.
    """
    return read_range(fs, path, 0, limit + 1)


def read_range(fs: AbstractFileSystem, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object, fewer where it ends sooner (none where
    it ends at or before ``start``); no request where the range is empty.

    Raises:
        FileNotFoundError: No such object (not checked for an empty range).
        Exception: The store's own error.
    """
    if end <= start:
        return b""
    try:
        return bytes(fs.cat_file(path, start=start, end=end))
    except Exception as exc:
        if unsatisfiable_range(exc):
            return b""
        raise


def read_ranges(
    fs: AbstractFileSystem, paths: Sequence[str], starts: Sequence[int], ends: Sequence[int]
) -> list[bytes | BaseException]:
    """:func:`read_range` of each ``(path, start, end)``, concurrently where the
    filesystem can (fsspec's ``cat_ranges``); a failed range's exception takes its
    place in the answer (``on_error="return"``), in order.
    """
    if not len(paths) == len(starts) == len(ends):
        raise ValueError(f"{len(paths)} paths, {len(starts)} starts and {len(ends)} ends")
    asked = [n for n in range(len(paths)) if ends[n] > starts[n]]
    out: list[bytes | BaseException] = [b""] * len(paths)
    if not asked:
        return out
    pieces = fs.cat_ranges(
        [paths[n] for n in asked],
        [starts[n] for n in asked],
        [ends[n] for n in asked],
        on_error="return",
    )
    for n, piece in zip(asked, pieces, strict=True):
        if isinstance(piece, BaseException):
            out[n] = b"" if unsatisfiable_range(piece) else piece
        else:
            out[n] = bytes(piece)
    return out


class SpanSink:
    """Where the bytes of one range land: writable buffers laid end to end.

    A range of a payload object holds frames, gaps and tensors' raw bytes in turn;
    the reader lays the tensors' own memory where their bytes fall and scratch
    memory elsewhere, so a received chunk is copied once, to where it belongs.
    :meth:`window` is a piece of the same span (a range fetched in parallel pieces).

    Args:
        views: The buffers, in order; each writable and byte-addressed.
    """

    __slots__ = ("_ends", "_offset", "_views", "length")

    def __init__(self, views: Sequence[memoryview], _offset: int = 0, _length: int = -1) -> None:
        self._views = list(views)
        ends, at = [], 0
        for view in self._views:
            at += len(view)
            ends.append(at)
        self._ends = ends
        self._offset = _offset
        #: How many bytes this sink takes.
        self.length = at - _offset if _length < 0 else _length

    def __len__(self) -> int:
        return self.length

    def window(self, start: int, length: int) -> SpanSink:
        """Bytes ``[start, start + length)`` of this sink, as a sink of their own."""
        if start < 0 or length < 0 or start + length > self.length:
            raise ValueError(f"window {start}+{length} outside a sink of {self.length} bytes")
        inner = SpanSink.__new__(SpanSink)
        inner._views, inner._ends = self._views, self._ends
        inner._offset, inner.length = self._offset + start, length
        return inner

    def views(self) -> list[memoryview]:
        """This sink's memory, as the writable buffers it spans, in order (for a
        client that receives into memory instead of handing chunks over)."""
        out, at, left = [], self._offset, self.length
        n = bisect.bisect_right(self._ends, at)
        while left > 0:
            view = self._views[n]
            inner = at - (self._ends[n] - len(view))
            take = min(len(view) - inner, left)
            out.append(view[inner : inner + take])
            at += take
            left -= take
            n += 1
        return out

    def fill(self, answer: bytes | bytearray | memoryview) -> int:
        """A whole answer copied in from the start: its length (what does not fit is
        counted, not written: the caller compares the count with what it asked)."""
        return self.write_fitting(0, answer)

    def write_fitting(self, pos: int, data: bytes | bytearray | memoryview) -> int:
        """Copy what of ``data`` falls inside this sink when laid at ``pos``; return
        ``len(data)``: bytes past the sink's end are counted, never written."""
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        take = max(0, min(len(src), self.length - pos))
        if take:
            self.write(pos, src[:take])
        return len(src)

    def file(self) -> SinkFile:
        """This sink as a file written from its start (for a client that writes what
        it receives into a file object)."""
        return SinkFile(self)

    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` to bytes ``[pos, pos + len(data))`` of this sink."""
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        if pos < 0 or pos + len(src) > self.length:
            raise ValueError(f"{len(src)} bytes at {pos} overrun a sink of {self.length}")
        at = self._offset + pos
        n = bisect.bisect_right(self._ends, at)
        done = 0
        while done < len(src):
            view = self._views[n]
            inner = at - (self._ends[n] - len(view))
            take = min(len(view) - inner, len(src) - done)
            view[inner : inner + take] = src[done : done + take]
            done += take
            at += take
            n += 1


class SinkFile:
    """A :class:`SpanSink` as a file written front to back: what azure-storage-blob's
    ``readinto`` writes each downloaded chunk to (one chunk at a time: objckpt asks
    for no parallel chunks). Bytes past the sink's end are counted, not written, as
    :meth:`SpanSink.fill` does. Once closed it writes nothing more, only counts: a
    download that failed or was cancelled may leave a chunk task of the SDK running,
    and the sink's memory is the caller's again (a retry, a fallback's load)."""

    __slots__ = ("_closed", "_sink", "received")

    def __init__(self, sink: SpanSink) -> None:
        self._sink = sink
        self._closed = False
        #: Bytes written to this file (those past the sink's end included).
        self.received = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = memoryview(data).nbytes
        if not self._closed:
            self._sink.write_fitting(self.received, data)
        self.received += n
        return n

    def close(self) -> None:
        self._closed = True


async def receive_into(content: Any, sink: SpanSink, length: int | None) -> int:
    """An aiohttp body (``ClientResponse.content``, of ``length`` bytes where its
    Content-Length says) written into ``sink`` chunk by chunk as it is received (each
    chunk copied once; none joined first): how many bytes it had. A body longer than
    the sink (a store that ignored the Range) is not read on: the chunk that
    overflows is written up to the sink's end, and the count is the body's length, or
    where none was sent what was received so far (either way more than the sink, all
    a caller needs to know). A body cut short raises (aiohttp checks Content-Length)."""
    at = 0
    while True:
        chunk, end_of_http_chunk = await content.readchunk()
        if not chunk:
            if end_of_http_chunk:
                continue
            return at
        sink.write_fitting(at, chunk)
        at += len(chunk)
        if at > len(sink):  # not read on
            return max(length or 0, at)  # a decoded body may outgrow its length


def read_ranges_into(
    fs: AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    sinks: Sequence[SpanSink],
) -> list[int | BaseException]:
    """:func:`read_ranges` written into ``sinks`` (one per range, as long as it):
    how many bytes each answer had (more than its sink takes are counted, not
    written), or the range's exception in its place. For clients that answer with
    a body whole (one copy more than a streamed read)."""
    out: list[int | BaseException] = []
    for piece, sink in zip(read_ranges(fs, paths, starts, ends), sinks, strict=True):
        if isinstance(piece, BaseException):
            out.append(piece)
            continue
        out.append(sink.fill(piece))
    return out
