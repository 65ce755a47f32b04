"""What an upload worker process runs: write one payload object from staged bytes.

This module, and everything it imports, is free of torch. A worker gets each
tensor as its ``torch.save`` frame (built once per dtype and shape by the training
process, :class:`~objckpt.dcp.serialize.Framer`) and the place of its bytes in a
staging segment; it writes frame head, the segment's bytes and frame tail. So a
worker never imports torch: ~190 MiB less per worker, and a start of well under a
second instead of several.

State kept here lives only in worker processes (never in the training process):
their stores, kept so HTTP connections serve every later object and save (their
clients are the worker's process client cache, :mod:`objckpt.writers.clients`),
and their mappings of staging segments.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import os
import threading
from collections.abc import Mapping

from objckpt.dcp.upload import Applied, compressed, split_reused, stored_size, upload_payload
from objckpt.format.compress import parse_compression
from objckpt.format.payload import PayloadRecord
from objckpt.format.reused import BaseItem
from objckpt.options import UploadOptions
from objckpt.pipeline import lifeline
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.accounting import RequestCounter, counting
from objckpt.writers.clients import PROCESS_CLIENTS
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location

__all__ = [
    "Entry",
    "FramedRef",
    "SegmentRef",
    "init_worker",
    "ready",
    "upload_object",
    "worker_store",
]


@dataclasses.dataclass(frozen=True)
class SegmentRef:
    """Where a staged tensor's bytes are: picklable, sent to upload workers."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class FramedRef:
    """One stored tensor: ``head`` + the bytes at ``data`` + ``tail`` is its
    ``torch.save`` file (the frames of equal dtypes and shapes are one object, so a
    task pickles each distinct frame once)."""

    head: bytes
    data: SegmentRef
    tail: bytes


#: (item id, a framed staged tensor or bytes already serialized).
Entry = tuple[int, "FramedRef | bytes"]

# A worker's state, kept for its life; its upload threads share it under _LOCK.
_LOCK = threading.Lock()
#: Stores by settings, options and location (a store names its objects under one location,
#: and a worker may upload to several at once: saves in flight, a promotion's source
#: and destination). The newest few are kept; each shares its filesystem's clients.
_WORKER_STORES: collections.OrderedDict[tuple[object, ...], ObjectStore] = collections.OrderedDict()
_KEPT_STORES = 8
_WORKER_SEGMENTS: dict[str, mmap.mmap] = {}
#: How long a worker whose socket closed waits to see the training process exit
#: (the kernel closes a dead process's sockets as it exits, a moment apart).
_PARENT_EXIT_GRACE_SECONDS = 5.0


def init_worker(parent_pid: int) -> None:
    """Run once in each worker: exit (unlinking mapped segments) if the training
    process dies, see :mod:`objckpt.pipeline.lifeline`."""
    lifeline.watch_parent(parent_pid, _unlink_attached_segments)


def on_pool_gone(parent_pid: int) -> None:
    """The pool's socket closed without a goodbye. If that is because the training
    process died, unlink its segments here: the worker is about to exit, and its
    lifeline thread (which would have done it) dies with it."""
    if lifeline.wait_for_exit(parent_pid, timeout=_PARENT_EXIT_GRACE_SECONDS):
        _unlink_attached_segments()


def ready() -> int:
    """A no-op task (its pid): the pool uses it to know a worker is up."""
    return os.getpid()


def _unlink_attached_segments() -> None:
    """The training process died: its staging segments would outlive it in /dev/shm."""
    with _LOCK:
        paths = list(_WORKER_SEGMENTS)
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _forget_freed_segments() -> None:
    """Unmap staging segments the training process has freed (their file is gone):
    a mapping kept here would hold the memory after the trainer let it go. None is
    in use: the trainer frees a segment once every upload from it has ended."""
    with _LOCK:
        freed = [p for p in _WORKER_SEGMENTS if not os.path.exists(p)]
        mappings = [_WORKER_SEGMENTS.pop(p) for p in freed]
    for mapped in mappings:
        with contextlib.suppress(BufferError, ValueError):
            mapped.close()


def _segment(path: str) -> mmap.mmap:
    with _LOCK:
        mapped = _WORKER_SEGMENTS.get(path)
        if mapped is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            _WORKER_SEGMENTS[path] = mapped
        return mapped


def worker_store(location: Location, options: UploadOptions) -> ObjectStore:
    """Worker side: the store for ``location``. Its filesystem (clients, HTTP
    connections) is the worker's process client for the location's settings and
    these options (:data:`~objckpt.writers.clients.PROCESS_CLIENTS`, which also
    keeps fork safety), shared by every store built from them;
    ``options.max_parts_in_flight`` bounds each store's requests."""
    # A later save with other upload options or another retry policy gets a store
    # of its own (the client is still shared where the settings are the same).
    key = (
        location.protocol,
        repr(sorted(location.storage_options.items())),
        repr(location.retry),
        repr(options),
        os.getpid(),
        location.url,
    )
    with _LOCK:
        store = _WORKER_STORES.get(key)
        if store is not None:
            _WORKER_STORES.move_to_end(key)
            return store
        store = open_store(location, options, clients=PROCESS_CLIENTS, scope=repr(options))
        _WORKER_STORES[key] = store
        while len(_WORKER_STORES) > _KEPT_STORES:
            _WORKER_STORES.popitem(last=False)  # an upload using it keeps its reference
        return store


def _chunks(value: FramedRef | bytes) -> tuple[tuple[bytes | memoryview, ...], bool]:
    """An entry's stored bytes as chunks, and whether they stay valid (``kept``)."""
    if isinstance(value, FramedRef):
        ref = value.data
        # The segment is not released before every upload of the save has ended,
        # so the store may send these bytes from the mapping without a copy.
        data = memoryview(_segment(ref.path))[ref.offset : ref.offset + ref.nbytes]
        return (value.head, data, value.tail), True
    return (value,), False


def upload_object(
    location: Location,
    options: UploadOptions,
    key: str,
    entries: list[Entry],
    deadline: Deadline | None = None,
    reuse: Mapping[int, BaseItem] | None = None,
) -> PayloadRecord:
    """Worker side: write ``entries`` into the object ``key`` and upload it; every
    request is bounded by the save's ``deadline``.

    ``reuse`` maps an entry's id to the base step's item of the same identity: an
    entry whose stored bytes equal it (length and xxh3-128) is not written, and is
    returned in the record's ``reused``. When every entry is reused, the object is
    never created (no request at all).
    """
    _forget_freed_segments()
    entries, transforms = _compressed(entries, options)
    chains = {ident: chain for ident, chain, _ in transforms}
    stored = ((ident, *_chunks(value)) for ident, value in entries)
    to_write, reused = split_reused(stored, reuse or {}, chains)
    if not to_write:
        return PayloadRecord(0, "", (), reused=tuple(reused), transforms=transforms)
    store = worker_store(location, options)
    with counting(RequestCounter()) as counter, bounded_by(deadline):
        record, done = upload_payload(store, key, to_write, stored_size(to_write), reused)
        done.result()
    return dataclasses.replace(record, requests=counter.snapshot(), transforms=transforms)


def _compressed(
    entries: list[Entry], options: UploadOptions
) -> tuple[list[Entry], tuple[tuple[int, tuple[str, ...], int], ...]]:
    """With ``options.compression``: each entry as its compressed stored bytes, and
    what was applied to each (:mod:`objckpt.format.compress`); else as it is."""
    codec = parse_compression(options.compression)
    if codec is None:
        return entries, ()
    applied: list[Applied] = []
    items = (
        (ident, _chunks(value)[0], value.data.dtype if isinstance(value, FramedRef) else None)
        for ident, value in entries
    )
    out: list[Entry] = list(compressed(codec, items, applied))
    return out, tuple(applied)
