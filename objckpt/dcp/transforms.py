"""Stream transforms on stored items, in DCP's extension format: compression and ``_extensions``.

DCP's ``FileSystemWriter(_extensions=[...])`` passes each item's bytes through a
chain of ``StreamTransformExtension``\\ s and records their descriptors per item;
its readers undo them through an ``ExtensionRegistry``. objckpt writes the same
records, so a checkpoint transformed by either writer loads with either reader:

* ``UploadOptions(compression=...)``: objckpt's own codec
  (:mod:`objckpt.format.compress`), whose zstd items carry torch's ``stream.zstd/1``
  descriptor and whose byte-grouped items also carry ``objckpt.bytegroup/1``,
  undone by :class:`ByteGrouping` once registered;
* ``ObjectStoreWriter(_extensions=[...])``: any extension, applied exactly as
  torch's writer applies them (same order, same descriptors).

Compression is one path (:func:`objckpt.dcp.upload.compressed`): the upload workers
run it on staged bytes, the sync writer here, item by item, as the payload is
written; DCP extensions are the sync writer's only.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem

from objckpt._torch import StreamTransformExtension, require_stream_transforms
from objckpt.dcp.serialize import Framer, stored_chunks
from objckpt.dcp.upload import Applied, compressed
from objckpt.errors import ConfigurationError
from objckpt.format.compress import (
    BYTEGROUP,
    BYTEGROUP_NAME,
    Codec,
    group_stream,
    parse_compression,
    ungroup_stream,
)
from objckpt.format.dcp_json import dtype_name
from objckpt.writers.checksum import BytesLike

__all__ = ["ByteGrouping", "ItemTransforms"]


def _dtype(data: torch.Tensor | BytesLike) -> str | None:
    """A tensor's dtype name (its framed bytes may be grouped by element width)."""
    return dtype_name(data.dtype) if isinstance(data, torch.Tensor) else None


class ByteGrouping(StreamTransformExtension):
    """objckpt's byte-grouping transform as a DCP extension (``objckpt.bytegroup/1``).

    Register it so torch's stock readers load items objckpt stored with
    ``UploadOptions(compression="bytegroup+zstd")``::

        registry = ExtensionRegistry()        # torch.distributed.checkpoint._extension
        registry.register(objckpt.ByteGrouping)
        dcp.load(sd, storage_reader=FileSystemReader(path, _extension_registry=registry))

    As a writer extension (``_extensions=[ByteGrouping(4), ZStandard()]``) it
    groups a whole stream by ``width`` bytes (it cannot tell a tensor's bytes from
    the ``torch.save`` container around them, which objckpt's own writer can).

    Args:
        width: Element width in bytes to group by when writing.
    """

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        if not isinstance(width, int) or not 1 <= width <= 255:
            raise ConfigurationError(f"ByteGrouping(width={width!r}): expected an int 1-255")
        self.width = width

    @staticmethod
    def registry_name() -> str:
        return BYTEGROUP_NAME

    @staticmethod
    def from_descriptor(version: str) -> ByteGrouping:
        if version.partition(".")[0] != "1":
            raise ValueError(f"unknown {BYTEGROUP_NAME} version {version!r}")
        return ByteGrouping()

    def get_descriptor(self) -> str:
        return BYTEGROUP

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _GroupingWriter(output, self.width))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(ungroup_stream(input.read(), what="byte-grouped stream"))


class _GroupingWriter(io.RawIOBase):
    """Collects a stream; on close writes it grouped to ``output`` and closes it
    (DCP's writers expect a transform's close to cascade)."""

    def __init__(self, output: IO[bytes], width: int) -> None:
        super().__init__()
        self._output = output
        self._width = width
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._buf += view
        return view.nbytes

    def close(self) -> None:
        if self.closed:
            return
        self._output.write(group_stream(self._buf, self._width))
        self._output.close()
        super().close()


class _NoClose(io.RawIOBase):
    """The item's buffer under a transform chain: its close is a flush (as in DCP)."""

    def __init__(self, raw: io.BytesIO) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.flush()


class ItemTransforms:
    """What a sync writer applies to each item's stored bytes: the compression
    codec, or DCP ``_extensions``, or nothing.

    Args:
        compression: ``UploadOptions.compression``.
        extensions: DCP's ``_extensions`` (``StreamTransformExtension`` instances).

    Raises:
        ConfigurationError: Both given, or an extension that is not a stream transform.
    """

    def __init__(
        self, compression: str | None, extensions: Sequence[StreamTransformExtension] | None
    ) -> None:
        self.codec: Codec | None = parse_compression(compression)
        self.extensions = tuple(extensions or ())
        if self.extensions:
            require_stream_transforms("ObjectStoreWriter(_extensions=...)")
        for ex in self.extensions:
            if not isinstance(ex, StreamTransformExtension):
                raise ConfigurationError(
                    f"option _extensions holds {type(ex).__name__}, expected DCP "
                    "StreamTransformExtension instances (e.g. ZStandard())"
                )
        if self.codec is not None and self.extensions:
            raise ConfigurationError(
                f"options compression={compression!r} and _extensions are both set; "
                "use one (compression is objckpt's zstd in DCP's extension format)"
            )

    @property
    def active(self) -> bool:
        return self.codec is not None or bool(self.extensions)

    def wrap(
        self,
        entries_of: Callable[[Any], Iterable[tuple[int, torch.Tensor | BytesLike]]],
        framer: Framer,
    ) -> tuple[
        Callable[[Any], Iterable[tuple[int, torch.Tensor | BytesLike]]],
        Callable[[Sequence[WriteItem]], list[tuple[WriteItem, tuple[str, ...], int]]],
    ]:
        """``entries_of`` (an object's entries) transformed, and what was applied to
        the items so far, as (write item, descriptors, length before them)."""
        applied: list[Applied] = []

        def transformed(obj: Any) -> Iterable[tuple[int, torch.Tensor | BytesLike]]:
            entries, done = self.entries(entries_of(obj), framer)
            applied_lists.append(done)
            return entries

        applied_lists: list[list[Applied]] = [applied]

        def so_far(items: Sequence[WriteItem]) -> list[tuple[WriteItem, tuple[str, ...], int]]:
            return [(items[i], d, r) for lst in applied_lists for i, d, r in lst]

        return transformed, so_far

    def entries(
        self, entries: Iterable[tuple[int, torch.Tensor | BytesLike]], framer: Framer
    ) -> tuple[Iterator[tuple[int, torch.Tensor | BytesLike]], list[Applied]]:
        """``entries`` as their transformed stored bytes (lazily, one item at a
        time), and the list of what was applied, complete once they are consumed."""
        applied: list[Applied] = []
        if not self.active:
            return iter(entries), applied
        return self._transformed(entries, framer, applied), applied

    def _transformed(
        self,
        entries: Iterable[tuple[int, torch.Tensor | BytesLike]],
        framer: Framer,
        applied: list[Applied],
    ) -> Iterator[tuple[int, torch.Tensor | BytesLike]]:
        if self.codec is not None:  # the upload workers' path (objckpt.dcp.upload)
            items = (
                (ident, stored_chunks(data, framer)[0], _dtype(data)) for ident, data in entries
            )
            yield from compressed(self.codec, items, applied)
            return
        for ident, data in entries:
            chunks, _ = stored_chunks(data, framer)
            stored, descriptors, raw = self._extended(chunks)
            applied.append((ident, descriptors, raw))
            yield ident, stored

    def _extended(self, chunks: Sequence[BytesLike]) -> tuple[bytes, tuple[str, ...], int]:
        """Through the extension chain as torch's ``FileSystemWriter`` does it."""
        buf = io.BytesIO()
        stream: IO[bytes] = cast(IO[bytes], _NoClose(buf))
        for ex in self.extensions:
            stream = ex.transform_to(stream)
        for chunk in chunks:
            stream.write(memoryview(chunk).cast("B"))
        stream.close()
        raw = sum(memoryview(c).nbytes for c in chunks)
        descriptors = tuple(ex.get_descriptor() for ex in reversed(self.extensions))
        return buf.getvalue(), descriptors, raw
