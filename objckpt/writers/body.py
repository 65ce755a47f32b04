"""The bytes of a part (an S3 part, an Azure block, a GCS piece): gathered from writes
and sent without copying them whole.

A part is 16 MiB by default (``UploadOptions.part_size``) and a save sends many
at once, so every whole copy of a part costs real host memory and a pass over it.
:class:`~objckpt.writers.base.PartedUpload` cuts what is written into parts, each a
:class:`Part` (small writes copied into one buffer, kept writes referenced where they
lie, with its CRC32C); :class:`StreamedBody` hands a part's pieces to aiohttp a slice
at a time, so neither aiohttp nor the event loop's transport copies the part whole.
One implementation for every store that uploads in parts, so a part is cut,
checksummed and held the same way on each. It imports nothing of objckpt's but
checksums, so every store client may use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from objckpt.writers.checksum import COMBINE_ABOVE, BytesLike, crc32c_combine, crc32c_of

__all__ = ["Part", "StreamedBody"]


class StreamedBody:
    """A request body aiohttp sends in slices: a part's bytes, never copied whole.

    Given a ``bytearray``, aiohttp slices it to the Content-Length (a copy of the
    whole part) and hands it to the event loop's transport, which on Python 3.11 copies
    whatever the socket does not take at once into a per-connection buffer that keeps
    its size: two copies of each part, and up to a part of memory per pooled connection
    for the life of the process. As an async iterable of ``chunk``-byte views, the body
    is written a slice at a time with a drain between slices, so the copies are gone and
    each connection buffers at most one slice. botocore sees a sized, seekable stream
    (``read``/``seek``/``tell``), which it may rewind before a retry; each send streams
    the whole body from the start. ``read`` resumes where the last one stopped (an
    SDK that hashes a body reads it 4 KiB at a time; azure-storage-blob's Content-MD5
    does), so reading the whole body costs one pass, however many pieces it has.

    ``data`` is one buffer or a sequence of them (a part gathered from several
    places: a frame's head, a staged tensor's bytes, its tail), sent in order.
    """

    def __init__(self, data: BytesLike | list[BytesLike], chunk: int = 1024 * 1024) -> None:
        pieces = data if isinstance(data, list) else [data]
        self._views = [memoryview(p).cast("B") for p in pieces]
        self._views = [v for v in self._views if v.nbytes]
        self._size = sum(v.nbytes for v in self._views)
        self._chunk = chunk
        self._pos = 0
        self._at = (0, 0)  # the view ``_pos`` lies in, and the offset in it

    def __len__(self) -> int:
        return self._size

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._pos + size, self._size)
        out: list[memoryview] = []
        index, offset = self._at
        while self._pos < end:
            view = self._views[index]
            take = min(view.nbytes - offset, end - self._pos)
            out.append(view[offset : offset + take])
            self._pos += take
            offset += take
            if offset == view.nbytes:
                index, offset = index + 1, 0
        self._at = (index, offset)
        return b"".join(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, min(base + offset, self._size))
        left = self._pos
        for index, view in enumerate(self._views):
            if left < view.nbytes:
                self._at = (index, left)
                break
            left -= view.nbytes
        else:
            self._at = (len(self._views), 0)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._slices()

    async def _slices(self) -> AsyncIterator[memoryview]:
        step = self._chunk
        for view in self._views:
            for start in range(0, view.nbytes, step):
                yield view[start : start + step]


class Part:
    """The bytes of one part as they arrive, with their size and CRC32C.

    Copies of what :meth:`~objckpt.writers.base.PartedUpload.write` got (consecutive
    small writes share one buffer) and, without a copy, what
    :meth:`~objckpt.writers.base.PartedUpload.write_kept` got.
    """

    def __init__(self) -> None:
        self.pieces: list[BytesLike] = []
        self.size = 0
        self.crc = 0
        self._open: bytearray | None = None  # the copy buffer later copies extend

    def add(self, piece: memoryview, crc: int, *, copy: bool) -> None:
        """Append ``piece``, whose CRC32C is ``crc``."""
        if piece.nbytes < COMBINE_ABOVE:  # rehashing is cheaper than combining
            self.crc = crc32c_of(piece, self.crc)
        else:
            self.crc = crc32c_combine(self.crc, crc, piece.nbytes)
        if not copy:
            self.pieces.append(piece)
            self._open = None
        elif self._open is not None:
            self._open += piece
        else:
            self._open = bytearray(piece)
            self.pieces.append(self._open)
        self.size += piece.nbytes

    def __add__(self, other: Part) -> Part:
        joined = Part()
        joined.pieces = self.pieces + other.pieces
        joined.size = self.size + other.size
        joined.crc = crc32c_combine(self.crc, other.crc, other.size)
        return joined
