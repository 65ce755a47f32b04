"""DCP's ``.metadata`` pickle, written a few entries at a time.

``.metadata`` holds one entry per stored item (9.8 million at 8,192 ranks). Built as
one ``Metadata`` object and pickled in one call, every item, its key and the
pickler's memo entry for each of their parts are alive at once: about 2.1 kB per
item in rank 0's commit helper, 17 GiB at 8,192 ranks. Here the same pickle is
written in pieces: the ``Metadata`` object's header, its ``state_dict_metadata`` a
tensor at a time, ``planner_data``, then ``storage_data``'s entries a batch at a time
as each rank's index object is decoded (and dropped), then the rest. A stock
reader's plain ``pickle.load`` builds the same ``Metadata``.

How: a pickle is a program for a stack machine, and one value's pickle is the
opcodes that push it, between a PROTO header and STOP. The stream here is PROTO,
the opcodes that make an empty ``Metadata`` (NEWOBJ) and push its state dict, then
for each dict being filled MARK, key and value opcodes, SETITEMS, and at the end
BUILD (which sets the state on the object) and STOP. A batch's keys and values are
pickled as one flat tuple (MARK k1 v1 k2 v2 ... TUPLE PUT): its MARK is kept and the
closing TUPLE and PUT are replaced by SETITEMS.

One pickler writes every piece, so classes and strings it has seen are referenced
from its memo (a GET) rather than written again. After each batch its memo is reset
to its first entries (DCP's classes), which is what bounds the memory. That needs
protocol 3: its memo entries carry their numbers (BINPUT n), so a batch reuses the
numbers of the batch before and overwrites them in the reader's memo. Protocol 4's
MEMOIZE numbers entries by count, so after a reset its GETs would name the wrong
objects. Batches of :data:`BATCH` entries keep the numbers below 256, one byte each.
The cost is size: an item's key no longer shares its chunk's offsets, and names
are written again in each batch.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from objckpt._torch import storage_info
from objckpt.errors import InternalError

__all__ = ["BATCH", "MetadataStream"]

PROTOCOL = 3
#: Entries per batch: a ``storage_data`` entry memoizes about 6 objects (the key, its
#: constructor's arguments and offsets, the storage info and its arguments, its name
#: where new), so 36 keep the memo below 256 after the few shared entries.
BATCH = 36
_STORAGE_INFO = type(storage_info("", 0, 0))

# The opcodes written directly (pickle's own names; see pickletools).
_MARK, _SETITEMS, _EMPTY_DICT, _EMPTY_TUPLE = b"(", b"u", b"}", b")"
_NEWOBJ, _BUILD, _POP, _STOP = b"\x81", b"b", b"0", b"."
_TUPLE, _TUPLE2, _BINPUT, _LONG_BINPUT = b"t", b"\x86", b"q", b"r"


def _reduce_storage_info(info: Any) -> tuple[Any, tuple[Any, ...]]:
    """``_StorageInfo`` rebuilt by its constructor (what its ``__getstate__`` keeps:
    the transform descriptors only when there are any)."""
    if info.transform_descriptors is None:
        return type(info), (info.relative_path, info.offset, info.length)
    return type(info), (info.relative_path, info.offset, info.length, info.transform_descriptors)


class _Pickler(pickle.Pickler):
    """Sooner and smaller: ``torch.Size``, DCP's ``ChunkStorageMetadata``,
    ``MetadataIndex`` and ``_StorageInfo`` (a few per item) reduced by their
    constructors through table entries, instead of their Python
    ``__reduce__``/``__getstate__`` or a state dict each. Each rebuilds the same
    object when unpickled, by the same class."""

    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Size] = lambda size: (torch.Size, (tuple(size),))
    dispatch_table[_STORAGE_INFO] = _reduce_storage_info
    dispatch_table[ChunkStorageMetadata] = lambda c: (ChunkStorageMetadata, (c.offsets, c.sizes))
    # MetadataIndex's constructor makes its offsets a torch.Size: a plain tuple will do.
    dispatch_table[MetadataIndex] = lambda i: (
        MetadataIndex,
        (i.fqn, None if i.offset is None else tuple(i.offset), i.index),
    )


class MetadataStream:
    """One ``.metadata`` pickle, written in the order :meth:`begin`, :meth:`add`
    (any number of times), :meth:`end`."""

    def __init__(self) -> None:
        self._out = io.BytesIO()
        self._scratch = io.BytesIO()
        self._pickler = _Pickler(self._scratch, protocol=PROTOCOL)
        self._out.write(bytes((pickle.PROTO[0], PROTOCOL)))
        # The shared memo entries: the classes every batch refers to, pushed once
        # and popped (they stay in the reader's memo under their numbers).
        shared = (Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata)
        self._out.write(self._body((*shared, MetadataIndex, _STORAGE_INFO, torch.Size)))
        self._out.write(_POP)
        self._shared = self._pickler.memo.copy()
        self._stage = "new"

    def begin(self, state_dict_metadata: Mapping[str, Any], planner_data: Any) -> None:
        """The ``Metadata`` object, its ``state_dict_metadata`` (a tensor at a time)
        and ``planner_data``; ``storage_data`` is left open for :meth:`add`."""
        self._expect("begin", "new", "open")
        out = self._out
        out.write(self._body(Metadata) + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK)
        out.write(self._body("state_dict_metadata") + _EMPTY_DICT)
        for fqn, md in state_dict_metadata.items():
            self._setitems([fqn, md])
        out.write(self._body("planner_data") + self._body(planner_data))
        out.write(self._body("storage_data") + _EMPTY_DICT)
        self._pickler.memo = self._shared.copy()

    def add(self, entries: Iterable[tuple[Any, Any]]) -> None:
        """``storage_data`` entries (key, value), pickled and released a batch at a time."""
        self._expect("add", "open", "open")
        batch: list[Any] = []
        for key, value in entries:
            batch += (key, value)
            if len(batch) == 2 * BATCH:
                self._setitems(batch)
                batch = []
        if batch:
            self._setitems(batch)

    def end(self, storage_meta: Any, version: str | None) -> bytes:
        """The rest of the ``Metadata`` state; the whole pickle."""
        self._expect("end", "open", "ended")
        self._out.write(self._tail(storage_meta, version))
        return self._out.getvalue()

    def _tail(self, storage_meta: Any, version: str | None) -> bytes:
        """What :meth:`end` writes: the same bytes for the same arguments whatever
        came before (the memo is back to the shared entries after every batch)."""
        return (
            self._body("storage_meta")
            + self._body(storage_meta)
            + self._body("version")
            + self._body(version)
            + _SETITEMS
            + _BUILD
            + _STOP
        )

    @classmethod
    def tail(cls, storage_meta: Any, version: str | None) -> bytes:
        """The bytes a pickle ending with ``storage_meta`` and ``version`` ends with:
        a pickle of the same items for another save is the one before with its
        tail replaced (:mod:`objckpt.pipeline.stock_task`'s template)."""
        stream = cls()
        stream._stage = "ended"
        return stream._tail(storage_meta, version)

    def _expect(self, call: str, stage: str, then: str) -> None:
        if self._stage != stage:
            raise InternalError(f"internal: MetadataStream.{call} when it is {self._stage}")
        self._stage = then

    def _body(self, value: Any) -> bytes:
        """The opcodes that push ``value`` (its pickle without PROTO and STOP)."""
        scratch = self._scratch
        scratch.seek(0)
        scratch.truncate()
        self._pickler.dump(value)
        data = scratch.getvalue()
        return data[2:-1]

    def _setitems(self, flat: list[Any]) -> None:
        """MARK, the (key, value) pairs ``flat`` alternates, SETITEMS: into the dict
        below on the reader's stack. Then the memo is reset to the shared entries."""
        body = self._body(tuple(flat))
        # The tuple's own ending: TUPLE (TUPLE2 for one pair), then the PUT of its memo
        # entry, the last one made (numbered by the memo's size before it).
        last = len(self._pickler.memo.copy()) - 1
        put = _BINPUT + bytes((last,)) if last < 256 else _LONG_BINPUT + last.to_bytes(4, "little")
        if not body.endswith(put):
            raise InternalError(f"internal: a pickled tuple ends {body[-6:]!r}, not with {put!r}")
        body = body[: -len(put)]
        if len(flat) == 2 and body.endswith(_TUPLE2):
            body = _MARK + body[:-1]
        elif len(flat) > 3 and body.startswith(_MARK) and body.endswith(_TUPLE):
            body = body[:-1]
        else:
            raise InternalError(f"internal: a pickled {len(flat)}-tuple ends {body[-6:]!r}")
        self._out.write(body + _SETITEMS)
        self._pickler.memo = self._shared.copy()
