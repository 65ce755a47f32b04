"""One filesystem client per process and set of store settings, shared by its users.

Why: a new s3fs filesystem pays on its first request for a new botocore session
and client: the S3 service model and endpoint rules parsed again (~60 ms of CPU and
~35,000 Python objects that every later full garbage collection walks), a new
connection pool and new TCP connections. A training process that built a writer
per save, a reader per load and a store per listing paid that each time (measured at
0.25 GiB: a new writer per save in a warm process cost 2.49 client CPU-s/GiB, 1.07
with one shared client, as much as a reused writer; ``docs/benchmarks.md``). s3fs
has an instance cache for this, unbounded and keyed by a token of the options;
objckpt opens ``fresh=True`` filesystems and keeps its own cache here.

What may share a client: stores built from the same protocol, the same
``storage_options`` (credentials included), the same :class:`~objckpt.RetryPolicy`
(it lives on the client) and the same store-related environment (``AWS_*``,
``GOOGLE_*``, ``AZURE_*``, ... and proxy variables, which the SDKs read when the
client is built). Anything that differs gets its own client, and so do options that
cannot be compared (an unhashable value). Per-save state does not live on the client:
deadlines and request counters are context variables
(:mod:`~objckpt.writers.deadline`, :mod:`~objckpt.writers.accounting`), so each
request on a shared client is still bounded and counted by the save that makes it.

The cache is explicit: :data:`PROCESS_CLIENTS`, bounded (the newest
:data:`KEPT_CLIENTS` settings; an evicted client stays usable by whoever holds
it), emptied by :meth:`ClientCache.clear`, and bypassed with fsspec's own word
for it, ``storage_options={"skip_instance_cache": True}`` (or
:meth:`Location.open_fs(fresh=True) <objckpt.writers.location.Location.open_fs>`).
Its keys hold credentials: they are never logged, formatted or returned.

Listings: s3fs, gcsfs and adlfs keep what they listed (each object's size and ETag)
in the filesystem and answer later ``info`` calls from it, and a read then requires
that ETag. Across a client's users and its process-long life that answer goes stale (seen:
a backup read ``.metadata`` with the ETag of an object since replaced, and failed
with ``FileExpired``). Shared S3, GCS and Azure clients are therefore built with
``use_listings_cache=False`` unless the options say otherwise: objckpt drops the cache
before every listing anyway, so only stale answers are lost.

Owned clients: shared clients, and fsspec's IO loop they send requests from (a
thread, its epoll descriptor and self-pipe), live as long as the process. An
owner whose ``close()`` promises to give back everything it took (an
:class:`~objckpt.AsyncCheckpointer`) builds its clients with :class:`OwnedClients`
instead: on an event loop thread of its own, closed with their connections, the
loop's DNS threads and the thread itself when the owner closes. That costs one
client build per owner (once per training job), not per save.

Fork: a client holds sockets and a session bound to an event loop thread that a
forked child does not have. The cache is emptied in a forked child
(``os.register_at_fork``) and checks its process id on every lookup; the parent's
clients are dropped there, never closed (closing would run on the parent's loop).
Spawned interpreters, such as objckpt's upload workers, start with an empty cache.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem

from objckpt.errors import ConfigurationError
from objckpt.writers.location import Location

__all__ = ["KEPT_CLIENTS", "PROCESS_CLIENTS", "ClientCache", "OwnedClients", "shared_filesystem"]

logger = logging.getLogger(__name__)

#: How many distinct store settings keep their client (the least recently used goes).
KEPT_CLIENTS = 8

#: Protocols whose filesystems keep listings (see "Listings" above).
_LISTING_CACHES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})

#: Environment variables the store SDKs read when a client is built (by prefix).
_ENV_PREFIXES = ("AWS_", "BOTO_", "GOOGLE_", "GCE_", "GCS_", "GCSFS_", "CLOUDSDK_", "AZURE_")
_ENV_NAMES = frozenset(
    {
        "STORAGE_EMULATOR_HOST",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "REQUESTS_CA_BUNDLE",
        "SSL_CERT_FILE",
    }
)


def _frozen(value: Any) -> Hashable:
    """A hashable, type-exact stand-in for an option value (TypeError if there is none).

    The type is part of it so that ``True``, ``1`` and ``1.0`` (equal in Python) are
    different settings; mappings compare as sorted items, sequences as tuples.
    """
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_frozen(v) for v in value))
    hash(value)  # raises TypeError for an unhashable object
    return (type(value).__qualname__, value)


def _settings(location: Location) -> Hashable | None:
    """Everything a client for ``location`` is built from; None when the options
    cannot be compared (such a location always gets a client of its own)."""
    try:
        options = _frozen(location.storage_options)
    except TypeError:
        return None
    env = tuple(
        sorted(
            (k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES
        )
    )
    return (location.protocol, options, location.retry, env)


def _built(location: Location, loop: asyncio.AbstractEventLoop | None = None) -> AbstractFileSystem:
    """A new client for ``location``, fit to be shared (no listings kept by default),
    on ``loop`` (None: fsspec's)."""
    options = location.storage_options
    if location.protocol in _LISTING_CACHES and "use_listings_cache" not in options:
        options = {**options, "use_listings_cache": False}
        location = dataclasses.replace(location, storage_options=options)
    return location.open_fs(fresh=True, loop=loop)


class ClientCache:
    """Filesystem clients by the settings they were built from, for one process.

    Args:
        limit: How many distinct settings keep their client.
    """

    def __init__(self, limit: int = KEPT_CLIENTS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._clients: collections.OrderedDict[Hashable, AbstractFileSystem] = (
            collections.OrderedDict()
        )
        self._pid = os.getpid()
        #: Clients this cache built (in this process), for tests and diagnostics.
        self.built = 0

    def filesystem(self, location: Location, scope: Hashable = None) -> AbstractFileSystem:
        """The client for ``location``'s settings: this process's shared one, or a
        new one (then kept) where none is.

        Args:
            scope: What else the client is kept apart by (an upload worker keeps
                one per ``UploadOptions``: every store on a client observes its
                retries, and a save with other options must not inherit another's
                throttling).

        Raises:
            ConfigurationError: The backend package is missing or rejects the options.
        """
        key = _settings(location)
        if key is None or location.storage_options.get("skip_instance_cache"):
            return location.open_fs(fresh=True)
        if scope is not None:
            key = (key, scope)
        with self._lock:
            self._forget_other_process()
            fs = self._clients.get(key)
            if fs is not None:
                self._clients.move_to_end(key)
                return fs
        # Built outside the lock: a backend may ask for credentials while it builds
        # (gcsfs), and other settings must not wait for that.
        new = _built(location)
        with self._lock:
            self._forget_other_process()
            fs = self._clients.setdefault(key, new)
            if fs is new:
                self.built += 1
                while len(self._clients) > self.limit:
                    self._clients.popitem(last=False)
            self._clients.move_to_end(key)
            return fs

    def clear(self) -> None:
        """Forget every client (their users keep theirs; the next lookup builds anew)."""
        with self._lock:
            self._clients.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def __repr__(self) -> str:  # never the keys: they hold credentials
        return f"ClientCache({len(self)} of {self.limit} kept, {self.built} built)"

    def _forget_other_process(self) -> None:
        """Drop (never close) a parent's clients in a forked child; caller holds the lock."""
        if self._pid != os.getpid():
            self._clients.clear()
            self._pid = os.getpid()
            self.built = 0

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it
        self._clients.clear()
        self._pid = os.getpid()
        self.built = 0


#: This process's clients (see the module docstring).
PROCESS_CLIENTS = ClientCache()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PROCESS_CLIENTS._after_fork_in_child)


def shared_filesystem(location: Location) -> AbstractFileSystem:
    """This process's client for ``location``'s protocol, options, retry policy and
    environment (:data:`PROCESS_CLIENTS`)."""
    return PROCESS_CLIENTS.filesystem(location)


class OwnedClients:
    """Filesystem clients built for one owner, on an event loop of its own, all
    released by :meth:`close` (see "Owned clients" in the module docstring).

    Args:
        name: Names the loop's thread (``<name>-io``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._clients: list[AbstractFileSystem] = []
        #: The clients by the settings they were built from (as :class:`ClientCache`).
        self._kept: dict[Hashable, AbstractFileSystem] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def filesystem(self, location: Location, scope: Hashable = None) -> AbstractFileSystem:
        """The client for ``location``'s settings (and ``scope``, as
        :meth:`ClientCache.filesystem`), owned here: built with the first location
        of those settings (an async one on this owner's loop, started with the
        first), then kept; settings that cannot be compared get a new one.

        Raises:
            ConfigurationError: The backend package is missing or rejects the
                options, or these clients are closed.
        """
        key = _settings(location)
        if key is not None and scope is not None:
            key = (key, scope)
        with self._lock:
            if self._closed:
                raise ConfigurationError(f"{self._name}: its clients are closed")
            kept = self._kept.get(key) if key is not None else None
            if kept is not None:
                return kept
            if self._loop is None and _is_async(location.protocol):
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name=f"{self._name}-io", daemon=True
                )
                self._thread.start()
            fs = _built(location, self._loop)
            self._clients.append(fs)
            if key is not None:
                self._kept[key] = fs
            return fs

    def close(self, timeout: float = 10.0) -> None:
        """Close the clients' connections, then end the loop, its executor threads
        (DNS lookups) and its thread; waits up to ``timeout`` seconds for each step.
        Requests still running (a save abandoned by its owner) are cancelled."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
            self._kept.clear()
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(_shut_down(clients), loop).result(timeout)
        except Exception:  # what is left goes with the loop, or when it is collected
            logger.warning("%s: closing its clients failed", self._name, exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("%s: its loop thread did not end within %g s", self._name, timeout)
        else:
            loop.close()


def _is_async(protocol: str) -> bool:
    """Whether ``protocol``'s filesystem sends its requests from an event loop."""
    try:
        return issubclass(fsspec.get_filesystem_class(protocol), AsyncFileSystem)
    except (ImportError, ValueError):  # open_fs says what is missing
        return False


async def _shut_down(clients: list[AbstractFileSystem]) -> None:
    """On the owned loop: close each client's connections (objckpt's S3 and GCS
    filesystems can; others close theirs when collected), cancel what still runs,
    and end the loop's default executor."""
    for fs in clients:
        close = getattr(fs, "close_connections", None)
        if close is not None:
            try:
                await close()
            except Exception:  # one client's failure must not keep the others open
                logger.debug("closing a client's connections failed", exc_info=True)
    current = asyncio.current_task()
    running = [t for t in asyncio.all_tasks() if t is not current]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_default_executor()
