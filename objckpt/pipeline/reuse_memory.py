"""What this rank wrote in its last committed save: the base of the next, read from memory.

A run that reuses unchanged items takes the step it just committed as the base of
its next save, almost always. Every rank already knows what it wrote in that save
(each item's object, offset, stored length, CRC32C and xxh3-128: its write
results), so it reads nothing of the store to look its items up: no manifest GET
and no ``decode_metadata`` per rank per save, which at 1,024 ranks and a manifest of
tens of MB would be the cost of every save; it only HEADs the objects it would
reference (:class:`~objckpt.dcp.reuse_base.BaseReader`: bytes deleted by hand since
cost those items their reuse, not every later save). The store is read only when
the agreed base is not the step this process remembers (after a restart, or when
the save that wrote it did not commit here).

A save is remembered when it is queued (:meth:`ReuseMemory.wrote`) and becomes
usable only once its handle reports it committed (:meth:`ReuseMemory.committed`, by
the manager's save flow), so a failed or refused save is never anyone's base. Each
:class:`~objckpt.pipeline.checkpointer.AsyncCheckpointer` owns one memory. The
commit still lists every referenced object and the base's manifest
(:mod:`objckpt.format.ref_check`): a memory that no longer matches the store fails a
save, never commits a dangling reference.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Any

from objckpt.dcp.reuse_base import Identity, identity
from objckpt.dcp.serialize import written_object
from objckpt.format.dcp_json import StoredItem
from objckpt.format.manifest import Manifest
from objckpt.format.refs import split_reference
from objckpt.format.reused import BaseItem
from objckpt.pipeline.deferred import DeferredWriter, Pending

__all__ = ["ReuseMemory"]

logger = logging.getLogger(__name__)

#: Saves queued and not known committed yet that one memory keeps (saves overlap by
#: one or two).
_QUEUED_MAX = 4


class ReuseMemory:
    """One checkpointer's memory of what its rank wrote (owned by the checkpointer, so
    two checkpointers in one process, say a model's and its EMA's, each remember
    their own last save).

    A save is remembered when it is queued (:meth:`wrote`) and becomes usable only
    once its handle reports it committed (:meth:`committed`), so a failed or refused
    save is never anyone's base. Thread-safe: saves are queued on the caller's thread
    and end on commit threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The saves queued last, not known committed yet: target URL -> (its uploads,
        #: its write items); never the writer itself, which would keep its staged
        #: memory referenced.
        self._queued: collections.OrderedDict[str, tuple[list[Pending], list[Any]]] = (
            collections.OrderedDict()
        )
        #: The last save known committed: (its URL, its items as a later step
        #: references them).
        self._remembered: tuple[str, dict[Identity, BaseItem]] | None = None
        #: The manifest of the step loaded last (its URL, the manifest every rank
        #: received from the load): a save based on that step takes it from here
        #: instead of every rank reading it again (W GETs of one key at a restart).
        self._loaded: tuple[str, Manifest] | None = None

    def wrote(self, url: str, writer: DeferredWriter) -> None:
        """A save to ``url`` was queued with ``writer`` (every rank, each its own)."""
        with self._lock:
            # The lists it goes on filling.
            self._queued[_url(url)] = (writer.pending, writer.items)
            self._queued.move_to_end(_url(url))
            while len(self._queued) > _QUEUED_MAX:
                self._queued.popitem(last=False)
            self._drop_loaded(url)  # a save to the loaded step replaces its manifest

    def forget(self, url: str) -> None:
        """The save to ``url`` ended without committing (or is no base): drop it."""
        with self._lock:
            self._queued.pop(_url(url), None)
            if self._remembered is not None and self._remembered[0] == _url(url):
                self._remembered = None
            self._drop_loaded(url)

    def committed(self, url: str) -> None:
        """The save queued for ``url`` committed (its handle said so on this rank): its
        items become what :meth:`recall` returns for ``url``."""
        with self._lock:
            queued = self._queued.pop(_url(url), None)
        if queued is None:
            return
        try:
            items = _items_of(url, *queued)
        except Exception as exc:  # the memory is an optimisation: the store still works
            logger.debug("not remembering the items of %s: %s", url, exc)
            items = None
        with self._lock:
            self._remembered = None if items is None else (_url(url), items)
            self._drop_loaded(url)

    def _drop_loaded(self, url: str) -> None:
        """Under the lock: forget the loaded manifest when ``url`` is its step."""
        if self._loaded is not None and self._loaded[0] == _url(url):
            self._loaded = None

    def loaded(self, url: str, manifest: Manifest) -> None:
        """The committed step ``url`` was loaded, its manifest ``manifest``."""
        with self._lock:
            self._loaded = (_url(url), manifest)

    def loaded_manifest(self, url: str) -> Manifest | None:
        """The manifest of the committed step ``url`` when it is the one loaded last
        (None: read the store)."""
        with self._lock:
            if self._loaded is None or self._loaded[0] != _url(url):
                return None
            return self._loaded[1]

    def recall(self, url: str) -> dict[Identity, BaseItem] | None:
        """This rank's items of the committed step ``url``, when it is the save this
        checkpointer remembers (None: read the store)."""
        with self._lock:
            if self._remembered is None or self._remembered[0] != _url(url):
                return None
            return self._remembered[1]


def _url(url: str) -> str:
    return url.rstrip("/")


def _items_of(
    url: str, pending: list[Pending], write_items: list[Any]
) -> dict[Identity, BaseItem] | None:
    step_dir = _url(url).rsplit("/", 1)[-1]
    try:
        split_reference(f"../{step_dir}/x")
    except Exception:
        return None  # not a step directory: never anyone's base
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    items: dict[Identity, BaseItem] = {}
    for upload in pending:
        record = upload.future.result(timeout=0)  # committed: every upload ended
        for result in written_object(upload.obj, write_items, record, done).write_results():
            stored = result.storage_data
            if not isinstance(stored, StoredItem) or stored.xxh3 is None:
                continue
            items[identity(result.index)] = BaseItem.stored_at(
                step_dir, stored, stored.object_size, stored.object_crc32c
            )
    return items
