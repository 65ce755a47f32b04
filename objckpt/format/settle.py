"""The commit's two checks: the objects are there, and what the manifest PUT did.

Why a module of its own: a save's commit (:mod:`objckpt.format.commit`),
``copy_checkpoint`` and promotion all end the same way, and each used to settle
its outcome differently (or not at all).

**Before the manifest**, :func:`require_present` lists the checkpoint's directory
once and compares names and sizes with what the writers reported. A ``gc`` whose
grace is shorter than a save (promotions have no deadline) may have deleted early
objects; the save must then fail, never commit a manifest that names bytes that
are gone (after which local retention could delete the only full copy).

**The manifest PUT** (:func:`put_manifest`) can land while its caller sees an
error: the answer lost on the wire, a retry meeting its own earlier write (412),
the save's deadline cancelling a request the store had already applied. Reporting
such a save as failed is as wrong as reporting a failed one as committed, so any
error of the PUT is settled by reading the manifest back, once, in bounded time:

* it holds exactly the bytes this call sent (same size and CRC32C): committed;
* it holds other bytes: another writer committed (``CheckpointExistsError``); on
  an overwrite, our PUT did not land and the original error stands;
* it is absent: nothing was committed and the original error stands.

**After the manifest**, :func:`after_commit` runs what must follow a commit and
only a commit (``.metadata`` for stock DCP readers: a fixed name, so no attempt
may write it before it has won) under a bound of its own, because the manifest
PUT may have spent the save's deadline. A failure there is logged, never the
save's outcome: the checkpoint is committed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

from objckpt.errors import CheckpointExistsError, ManifestError, UploadError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.deadline import Deadline, bounded_by, current_deadline
from objckpt.writers.translate import describe

__all__ = ["SETTLE_SECONDS", "after_commit", "put_manifest", "require_present", "settling"]

logger = logging.getLogger(__name__)

#: Seconds the read-back and the writes after a commit may take when less than
#: this is left of the save's deadline (the manifest PUT may have spent it all).
SETTLE_SECONDS = 60.0

#: At most this many missing objects are named in an error (the count is always given).
_NAMED = 8


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


def require_present(store: ObjectStore, entries: Iterable[ObjectEntry]) -> None:
    """Check, with one listing of the checkpoint's directory (no HEAD per object),
    that every object in ``entries`` is there with its size (object stores only).

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
    found = {o.key: o.size for o in store.inventory()}
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


def _read_back(store: ObjectStore) -> bytes | None:
    """The manifest's bytes on the store, or None when it is absent."""
    try:
        return store.read(MANIFEST_KEY)
    except FileNotFoundError:
        return None


def _holder(data: bytes, url: str) -> str:
    """Who wrote the manifest ``data``, for messages."""
    try:
        return f"attempt {Manifest.from_json_bytes(data, url=url).attempt}"
    except ManifestError:
        return "a manifest objckpt cannot read"


def _sums(data: bytes) -> str:
    return f"{len(data)} bytes, CRC32C {crc32c_of(data):08x}"


def put_manifest(store: ObjectStore, data: bytes, *, overwrite: bool = False) -> None:
    """Write ``manifest.json`` (create-only unless ``overwrite``): the commit.

    Any error of the PUT is settled by reading the manifest back (see the module
    docstring); returning means the manifest on the store holds ``data``.

    Raises:
        CheckpointExistsError: Another writer's manifest is there (create-only), or
            the store says one exists and it cannot be read back.
        Exception: The PUT's own error, when the read-back shows it did not land
            (or the read-back fails too: the outcome is then unknown, and logged).
    """
    try:
        store.create(MANIFEST_KEY, data, overwrite=overwrite)
    except FileExistsError as exc:
        _settle_exists(store, data, exc)
    except Exception as exc:
        if not _landed(store, data, exc, overwrite=overwrite):
            raise


def _landed(store: ObjectStore, data: bytes, exc: Exception, *, overwrite: bool) -> bool:
    """After a failed manifest PUT: True when the manifest holds ``data`` (the PUT
    landed), False when it does not or cannot be read (logged).

    Raises:
        CheckpointExistsError: Another writer's manifest is there (create-only).
    """
    url = store.location.url
    try:
        with settling(store):
            found = _read_back(store)
    except Exception as read_exc:
        logger.error(
            "the manifest PUT of %s failed (%s) and reading it back failed too (%s): "
            "whether it committed is unknown; `objckpt verify %s` tells",
            url,
            describe(exc),
            describe(read_exc),
            url,
        )
        return False
    if found == data:
        logger.warning(
            "the manifest PUT of %s failed (%s), yet the manifest holds what it sent "
            "(%s): the save committed",
            url,
            describe(exc),
            _sums(data),
        )
        return True
    if found is not None and not overwrite:
        raise CheckpointExistsError(
            f"{url} was committed by {_holder(found, url)} while this save's manifest PUT "
            f"failed ({describe(exc)}); this save was not committed; the existing "
            "checkpoint is intact"
        ) from exc
    return False


def _settle_exists(store: ObjectStore, data: bytes, exc: FileExistsError) -> None:
    """The store says the manifest exists: ours (a retried PUT met its own earlier
    write) returns, anything else raises CheckpointExistsError."""
    url = store.location.url
    try:
        with settling(store):
            found = _read_back(store)
    except Exception as read_exc:
        raise CheckpointExistsError(
            f"{url} already has a manifest that cannot be read back ({describe(read_exc)}); "
            "this save was not committed"
        ) from exc
    if found is None:
        raise CheckpointExistsError(
            f"{url} was committed concurrently and its manifest cannot be read back "
            "(gone again); this save was not committed"
        ) from exc
    if found != data:
        raise CheckpointExistsError(
            f"{url} is already committed by {_holder(found, url)} ({_sums(found)}); this save "
            f"({_sums(data)}) was not committed; the existing checkpoint is intact"
        ) from exc
    logger.info("manifest of %s was already written by this attempt (retried PUT)", url)


def after_commit(store: ObjectStore, what: str, work: Callable[[], None]) -> bool:
    """Run ``work``, which must follow the commit (writing ``.metadata``), under
    :func:`settling`'s bound. Returns False, having logged why, when it failed:
    the checkpoint is committed all the same (objckpt's readers need only the
    manifest), so the save's outcome does not change."""
    try:
        with settling(store):
            work()
    except Exception as exc:
        logger.error(
            "%s committed, but %s failed (%s): stock DCP readers do not see this checkpoint "
            "yet and `objckpt verify` reports it; objckpt's readers load it",
            store.location.url,
            what,
            describe(exc),
        )
        return False
    return True
