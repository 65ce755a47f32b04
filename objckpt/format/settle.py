"""The commit's two checks: the objects are there, and what the manifest PUT did.

Why a module of its own: a save's commit (:mod:`objckpt.format.commit`),
``copy_checkpoint`` and promotion all end the same way, and each used to settle
its outcome differently (or not at all).

**Before the manifest**, :func:`require_present` lists the checkpoint's directory
once and compares names and sizes with what the writers reported. A ``gc`` whose
grace is shorter than a save (promotions have no deadline) may have deleted early
objects; the save must then fail, never commit a manifest that names bytes that
are gone (after which local retention could delete the only full copy).

**The manifest PUT** (:func:`put_manifest`, one case of :func:`create_settled`,
which an export's index goes through too) can land while its caller sees an
error: the answer lost on the wire, a retry meeting its own earlier write (412),
the save's deadline cancelling a request the store had already applied. Reporting
such a save as failed is as wrong as reporting a failed one as committed, so any
error of the PUT is settled by reading the manifest back, once, in bounded time:

* it holds exactly the bytes this call sent (same size and CRC32C): committed;
* it holds other bytes: another writer committed (``CheckpointExistsError``); on
  an overwrite, our PUT did not land and the original error stands;
* it is absent: nothing was committed and the original error stands.

**After the manifest**, :func:`finish_commit` runs what must follow a commit and
only a commit (``.metadata`` for stock DCP readers: a fixed name, so no attempt
may write it before it has won; then the objects only a replaced checkpoint
named) under a bound of its own, because the manifest PUT may have spent the
save's deadline. It is the one implementation of that step for every commit. A
failure there is logged, never the save's outcome: the checkpoint is committed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Set

from objckpt.errors import CheckpointExistsError, ManifestError, UploadError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.format.superseded import delete_superseded_after
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.deadline import Deadline, bounded_by, current_deadline, each_in_context
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

__all__ = [
    "SETTLE_SECONDS",
    "create_settled",
    "finish_commit",
    "finish_without_metadata",
    "listed_sizes",
    "manifest_holder",
    "put_manifest",
    "require_present",
    "settling",
]

logger = logging.getLogger(__name__)

#: Seconds the read-back and the writes after a commit may take when less than
#: this is left of the save's deadline (the manifest PUT may have spent it all).
SETTLE_SECONDS = 60.0

#: At most this many missing objects are named in an error (the count is always given).
_NAMED = 8

#: Listings :func:`listed_sizes` runs at once (spread directories, referenced steps).
LISTINGS_AT_ONCE = 16


@contextlib.contextmanager
def settling(store: ObjectStore) -> Iterator[None]:
    """Bound the requests made in this block by the save's deadline, or by
    :data:`SETTLE_SECONDS` from now when less than that is left of it."""
    current = current_deadline()
    if current is None or current.remaining() >= SETTLE_SECONDS:
        yield
        return
    fresh = Deadline.start(SETTLE_SECONDS, f"settling the commit of {store.location.url}")
    with bounded_by(fresh):
        yield


def listed_sizes(store: ObjectStore, keys: Iterable[str]) -> dict[str, int]:
    """The size of each of ``keys`` (relative to ``store``'s location) that is on the
    store, from one recursive listing per directory they are stored in
    (:meth:`~objckpt.writers.location.Location.listing_root`): the checkpoint's own,
    a referenced sibling step's, each spread directory's share of a step (up to 16
    for one digit of persistent prefixes, 256 for two), never a HEAD per object.
    The listings run :data:`LISTINGS_AT_ONCE` at a time where the store's client
    allows it (:attr:`~objckpt.writers.base.ObjectStore.lists_concurrently`): one
    after another, 256 listings were seconds of rank 0's commit."""
    here = store.location
    groups: dict[str, tuple[Location, list[str]]] = {}
    for key in keys:
        where = here.listing_root(key)
        groups.setdefault(where.url, (where, []))[1].append(key)

    def listed(group: tuple[Location, list[str]]) -> dict[str, int]:
        where, wanted = group
        listing = store if where == here else store.at(where)
        sizes = {o.key: o.size for o in listing.inventory()}
        base = len(where.path.rstrip("/")) + 1
        found = {}
        for key in wanted:
            size = sizes.get(here.key_path(key)[base:])
            if size is not None:
                found[key] = size
        return found

    lanes = LISTINGS_AT_ONCE if store.lists_concurrently else 1
    found: dict[str, int] = {}
    for part in each_in_context(listed, list(groups.values()), lanes=lanes, name="objckpt-list"):
        found.update(part)
    return found


def require_present(store: ObjectStore, entries: Iterable[ObjectEntry]) -> None:
    """Check, with one listing of the checkpoint's directory (no HEAD per object; one
    more per spread directory, :func:`listed_sizes`), that every object in
    ``entries`` is there with its size (object stores only).

    Raises:
        UploadError: Objects are missing or have another size; the message names
            them (the first few) and how many there are. Nothing was committed.
        StoreError: The listing failed.
    """
    want = {e.key: e.size for e in entries}
    if not want or store.location.is_local:
        # A local path may be node-local (a LocalTier: each rank's objects are on
        # its own node, out of the coordinator's sight); gc runs on object stores.
        return
    found = listed_sizes(store, want)
    missing = sorted(k for k in want if k not in found)
    wrong = sorted(k for k in want if k in found and found[k] != want[k])
    if not missing and not wrong:
        return
    url = store.location.url
    parts = []
    if missing:
        named = ", ".join(missing[:_NAMED]) + (", …" if len(missing) > _NAMED else "")
        parts.append(f"{len(missing)} of the {len(want)} objects it names are missing ({named})")
    if wrong:
        named = ", ".join(f"{k} is {found[k]} bytes, not {want[k]}" for k in wrong[:_NAMED])
        parts.append(f"{len(wrong)} have another size ({named})")
    raise UploadError(
        f"refusing to commit {url}: {'; '.join(parts)}; deleted since they were written "
        "(a `gc` with a grace shorter than the save?); nothing was committed"
    )


def _read_back(store: ObjectStore, key: str) -> bytes | None:
    """``key``'s bytes on the store, or None when it is absent."""
    try:
        return store.read(key)
    except FileNotFoundError:
        return None


def manifest_holder(data: bytes, url: str) -> str:
    """Who wrote the manifest ``data``, for messages."""
    try:
        return f"attempt {Manifest.from_json_bytes(data, url=url).attempt}"
    except ManifestError:
        return "a manifest objckpt cannot read"


def _sums(data: bytes) -> str:
    return f"{len(data)} bytes, CRC32C {crc32c_of(data):08x}"


def put_manifest(store: ObjectStore, data: bytes, *, overwrite: bool = False) -> None:
    """Write ``manifest.json`` (create-only unless ``overwrite``): the commit
    (:func:`create_settled`)."""
    create_settled(store, MANIFEST_KEY, data, overwrite=overwrite)


def create_settled(
    store: ObjectStore,
    key: str,
    data: bytes,
    *,
    overwrite: bool = False,
    holder: Callable[[bytes, str], str] = manifest_holder,
    lost: Callable[[], None] | None = None,
) -> None:
    """Write the commit point ``key`` (create-only unless ``overwrite``): every
    commit's one create-then-settle, the manifest's and an export's index alike.

    Any error of the PUT is settled by reading ``key`` back (see the module
    docstring); returning means ``key`` on the store holds ``data``.

    Args:
        holder: Who wrote other bytes found there, for messages (``(bytes, url)``).
        lost: Called when this call is known not to have committed (another
            writer's object is there, or the read-back shows the PUT did not land),
            before raising: what the caller staged for it may go. Never called when
            the outcome is unknown.

    Raises:
        CheckpointExistsError: Another writer's object is there (create-only), or
            the store says one exists and it cannot be read back.
        Exception: The PUT's own error, when the read-back shows it did not land
            (or the read-back fails too: the outcome is then unknown, and logged).
    """
    try:
        store.create(key, data, overwrite=overwrite)
    except FileExistsError as exc:
        _settle_exists(store, key, data, exc, holder, lost)
    except Exception as exc:
        landed = _landed(store, key, data, exc, overwrite, holder, lost)
        if landed is False and lost is not None:
            lost()
        if not landed:
            raise


def _landed(
    store: ObjectStore,
    key: str,
    data: bytes,
    exc: Exception,
    overwrite: bool,
    holder: Callable[[bytes, str], str],
    lost: Callable[[], None] | None,
) -> bool | None:
    """After a failed PUT of ``key``: True when it holds ``data`` (the PUT landed),
    False when it does not, None when it cannot be read (logged).

    Raises:
        CheckpointExistsError: Another writer's object is there (create-only).
    """
    url = store.location.url_of(key)
    try:
        with settling(store):
            found = _read_back(store, key)
    except Exception as read_exc:
        logger.error(
            "the PUT of %s failed (%s) and reading it back failed too (%s): "
            "whether it committed is unknown; `objckpt verify %s` tells",
            url,
            describe(exc),
            describe(read_exc),
            store.location.url,
        )
        return None
    if found == data:
        logger.warning(
            "the PUT of %s failed (%s), yet the %s holds what it sent (%s): committed",
            url,
            describe(exc),
            "manifest" if key == MANIFEST_KEY else key,
            _sums(data),
        )
        return True
    if found is not None and not overwrite:
        if lost is not None:
            lost()
        raise CheckpointExistsError(
            f"{store.location.url} was committed by {holder(found, url)} while this save's "
            f"PUT of {url} failed ({describe(exc)}); this save was not committed; the "
            "existing checkpoint is intact"
        ) from exc
    return False


def _settle_exists(
    store: ObjectStore,
    key: str,
    data: bytes,
    exc: FileExistsError,
    holder: Callable[[bytes, str], str],
    lost: Callable[[], None] | None,
) -> None:
    """The store says ``key`` exists: ours (a retried PUT met its own earlier write)
    returns, anything else raises CheckpointExistsError."""
    url = store.location.url
    try:
        with settling(store):
            found = _read_back(store, key)
    except Exception as read_exc:
        raise CheckpointExistsError(
            f"{url} already has a {key} that cannot be read back ({describe(read_exc)}); "
            "this save was not committed"
        ) from exc
    if found is None:
        raise CheckpointExistsError(
            f"{url} was committed concurrently and its {key} cannot be read back "
            "(gone again); this save was not committed"
        ) from exc
    if found != data:
        if lost is not None:
            lost()
        raise CheckpointExistsError(
            f"{url} is already committed by {holder(found, url)} ({store.location.url_of(key)}: "
            f"{_sums(found)}); this save ({_sums(data)}) was not committed; the existing "
            "checkpoint is intact"
        ) from exc
    logger.info("%s of %s was already written by this attempt (retried PUT)", key, url)


def finish_commit(
    store: ObjectStore,
    what: str,
    write: Callable[[], None] | None,
    superseded: Set[str],
    *,
    bound: Deadline | None = None,
    consequence: str = (
        "stock DCP readers do not see this checkpoint yet (they load the one it "
        "replaced, if any) and `objckpt verify` reports it; objckpt's readers load it"
    ),
) -> str | None:
    """Step 4 of every commit (a save's, in its thread or its helper process, a
    copy's, a promotion's, a backup's): ``write`` the new ``.metadata``, then delete
    ``superseded``, the objects only the replaced checkpoint named
    (:func:`~objckpt.format.superseded.delete_superseded_after`), but only once
    ``.metadata`` is replaced (a replaced one still points at them, as it does when
    ``write`` is None and the replaced checkpoint had one).

    Runs under ``bound``, else :func:`settling`'s. Returns None when ``.metadata``
    was written, else why not, having logged it: the checkpoint is committed all the
    same (objckpt's readers need only the manifest), so the outcome does not change;
    ``consequence`` says what the failure means to a reader.
    """
    reason = None
    with bounded_by(bound) if bound is not None else settling(store):
        if write is not None:
            try:
                write()
            except Exception as exc:
                reason = f"{what} failed: {describe(exc)}"
        written = reason is None and (write is not None or METADATA_KEY not in superseded)
        delete_superseded_after(store, written, set(superseded))
    if reason is not None:
        logger.error("%s committed, but %s: %s", store.location.url, reason, consequence)
    return reason


def finish_without_metadata(
    store: ObjectStore, superseded: Set[str], *, bound: Deadline | None = None
) -> str | None:
    """Step 4 of a commit that writes no ``.metadata`` (a save above
    ``UploadOptions.stock_metadata_max_ranks``, a copy of a step without one): delete
    whatever ``.metadata`` the URL holds, then ``superseded`` (:func:`finish_commit`).
    Left, that ``.metadata`` (a replaced checkpoint's, a stock DCP checkpoint's this
    one overwrote, one an interrupted ``rm`` left) would make a stock reader load
    another checkpoint than this one at this URL, and keep the objects it points at;
    gone, such a reader is refused naming ``.metadata`` until ``objckpt
    stock-metadata`` writes this step's. One HEAD, and a DELETE where there is one (no
    delete permission needed, no delete marker in a versioned bucket, on a new URL)."""

    def drop() -> None:
        if store.exists(METADATA_KEY):
            store.delete(METADATA_KEY)

    return finish_commit(
        store,
        f"deleting the {METADATA_KEY} this checkpoint replaces",
        drop,
        superseded,
        bound=bound,
        consequence=(
            "stock DCP readers may load the checkpoint it replaced at this URL; "
            "`objckpt verify` reports it (another attempt's); objckpt's readers load this one"
        ),
    )
