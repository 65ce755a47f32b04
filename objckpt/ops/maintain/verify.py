"""Checking and copying committed checkpoints without loading them into torch.

``verify_checkpoint`` reads every object the manifest names and compares its
size and CRC32C with the manifest, and decodes the manifest's metadata and every
index object with the bounds a load applies (:func:`check_loadable`: the load's own
functions, not a copy of them): the check a job should be able to run on a
checkpoint before trusting it (or before deleting the only other copy). Sizes and
CRC32Cs alone are not enough there: whoever can write the bucket can recompute them
for a crafted index, which a load then refuses.

``copy_checkpoint`` streams each object from one store to another, checking
the CRC32C on the way, then commits as a save does (:mod:`objckpt.format.settle`):
one listing proves every object arrived, the manifest goes create-only (settled by
reading it back on any error), and ``.metadata`` only after it. A copy that stops
half-way is, like a failed save, invisible and garbage for ``gc``; a copy that
fails or loses onto a committed destination leaves every byte of it unchanged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Collection

from torch.distributed.checkpoint.metadata import Metadata

from objckpt.dcp.manifest_source import opened_from
from objckpt.dcp.read_plan import ItemIndex
from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
    ManifestError,
    StoreError,
)
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.format.ref_check import require_referenced
from objckpt.format.refs import (
    holds_spread,
    is_reference,
    names_spread,
    referenced_step,
    require_step_directory,
)
from objckpt.format.settle import (
    finish_commit,
    finish_without_metadata,
    put_manifest,
    require_present,
)
from objckpt.format.steps import parse_step
from objckpt.format.superseded import previous_objects
from objckpt.ops.maintain.object_check import (
    ObjectCheck,
    Progress,
    check_object,
    copy_object,
    digest_check,
    holds_reference,
    stream_object,
)
from objckpt.ops.maintain.referenced import Siblings
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location

__all__ = [
    "CopyReport",
    "ObjectCheck",
    "Refusal",
    "VerifyReport",
    "check_backup_copy",
    "check_loadable",
    "commit_copy",
    "copy_checkpoint",
    "copy_object",
    "open_manifest",
    "require_loadable",
    "unnamed_metadata_check",
    "unnamed_metadata_entry",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` found.

    Attributes:
        objects: Each object's size and CRC32C check.
        refused: What a load would refuse in the manifest's metadata or an index
            object (:func:`check_loadable`), one check per object named.
    """

    url: str
    manifest: Manifest
    objects: tuple[ObjectCheck, ...]
    refused: tuple[ObjectCheck, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refused and all(o.problem is None for o in self.objects)

    @property
    def failures(self) -> tuple[ObjectCheck, ...]:
        return tuple(o for o in self.objects if o.problem is not None) + self.refused


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What a load refuses in one metadata object: its key, URL and the error."""

    key: str
    url: str
    error: ManifestError | IntegrityError

    def check(self, manifest: Manifest) -> ObjectCheck:
        """As a failed :class:`ObjectCheck` (the manifest itself: size 0, no CRC32C,
        being no object it lists)."""
        entry = manifest.object(self.key)
        size, crc = (entry.size, entry.crc32c) if entry is not None else (0, "")
        # The error names the object already when it is this one: said once.
        text = str(self.error)
        for what in ("manifest", "index"):
            text = text.removeprefix(f"{what} {self.url}: ")
        return ObjectCheck(self.key, size, crc, None, None, f"a load refuses it: {text}", self.url)


def check_loadable(
    store: ObjectStore,
    manifest: Manifest,
    *,
    skip: Collection[str] = (),
    parallel: int = 4,
) -> tuple[Metadata | None, tuple[Refusal, ...]]:
    """Decode the manifest's metadata and every index object (but those in ``skip``)
    with the functions and bounds a load uses (:func:`objckpt.dcp.manifest_source.opened_from`,
    :meth:`objckpt.dcp.read_plan.ItemIndex.check_shard`): a checkpoint that cannot
    load must never verify. Reads each index object (one GET each, ``parallel`` at
    once).

    Returns:
        The checkpoint's DCP metadata (None when the manifest's is refused) and what
        a load refuses, in index order.

    Raises:
        StoreError: An index object could not be read.
    """
    location = store.location
    try:
        opened = opened_from(manifest, location)
    except ManifestError as exc:
        return None, (Refusal(MANIFEST_KEY, location.url_of(MANIFEST_KEY), exc),)
    if opened.locator is None:  # format 1: the manifest places every item
        return opened.metadata, ()
    index = ItemIndex(opened, location, lambda: store)
    todo = [
        (shard, key)
        for shard, key in enumerate(opened.locator.index_keys)
        if key is not None and key not in skip
    ]

    def one(shard: int, key: str) -> Refusal | None:
        try:
            index.check_shard(shard)
        except (ManifestError, IntegrityError) as exc:
            return Refusal(key, location.url_of(key), exc)
        return None

    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        found = list(pool.map(lambda t: one(*t), todo))
    return opened.metadata, tuple(r for r in found if r is not None)


def open_manifest(store: ObjectStore) -> Manifest:
    """The committed manifest at ``store.location``.

    Raises:
        CheckpointNotFoundError: Nothing is there.
        CheckpointNotCommittedError: Objects but no manifest (a failed or running save).
        ManifestError: The manifest is invalid, or references other steps' objects
            while ``store`` is not a step directory (:mod:`objckpt.format.refs`).
    """
    try:
        manifest = read_manifest(store)
    except FileNotFoundError:
        url = store.location.url
        if store.listing():
            raise CheckpointNotCommittedError(
                f"{url} has no {MANIFEST_KEY}: the save that wrote it never committed"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {url}") from None
    url = store.location.url
    require_step_directory(url, (o.key for o in manifest.objects), f"manifest of {url}")
    return manifest


def require_loadable(store: ObjectStore, manifest: Manifest, *, parallel: int = 16) -> Metadata:
    """The checkpoint's DCP metadata, once its manifest and every index object pass
    what a load checks (:func:`check_loadable`; ``objckpt info``).

    Raises:
        ManifestError, IntegrityError: The first thing a load would refuse, naming
            the object and the bound.
        StoreError: An index object could not be read.
    """
    metadata, refused = check_loadable(store, manifest, parallel=parallel)
    if metadata is None or refused:  # no metadata comes with a refusal saying why
        raise refused[0].error
    return metadata


def verify_checkpoint(
    location: Location,
    *,
    manifest: Manifest | None = None,
    progress: Progress | None = None,
    parallel: int = 4,
) -> VerifyReport:
    """Read every object of a committed checkpoint and check it against the manifest.

    Objects the step references in sibling step directories (reuse) are read where
    they are stored and checked like its own; a problem with one names both steps.
    Then the manifest's metadata and each index object whose bytes check out are
    decoded as a load decodes them (:func:`check_loadable`): what a load refuses is
    reported too.

    Args:
        manifest: The checkpoint's manifest when the caller has read it already.
        progress: Called with bytes read, as reading goes (from worker threads).

    Raises:
        CheckpointNotFoundError, CheckpointNotCommittedError, ManifestError,
        StoreError: the checkpoint cannot be verified at all. Object mismatches
        are reported in the returned report, every one of them.
    """
    store = open_store(location)
    siblings = Siblings(store)
    try:
        manifest = manifest or open_manifest(store)
        for e in manifest.objects:
            siblings.resolve(e.key)  # open each sibling once, before the threads
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            checks = list(
                pool.map(lambda e: check_object(store, e, progress, siblings), manifest.objects)
            )
        if manifest.object(METADATA_KEY) is None:
            check = unnamed_metadata_check(
                store, manifest.attempt, progress, required=manifest.stock_metadata
            )
            checks += [] if check is None else [check]
        bad = {c.key for c in checks if c.problem}  # reported already, for their bytes
        _, refusals = check_loadable(store, manifest, skip=bad, parallel=parallel)
    finally:
        siblings.close()
        store.close()
    refused = tuple(r.check(manifest) for r in refusals)
    for c in checks + list(refused):
        if c.problem:
            logger.error("%s: %s", c.stored_at or location.url_of(c.key), c.problem)
    return VerifyReport(location.url, manifest, tuple(checks), refused)


def unnamed_metadata_check(
    store: ObjectStore, attempt: str, progress: Progress | None = None, *, required: bool = True
) -> ObjectCheck | None:
    """The check of a ``.metadata`` the manifest does not name: one an async save of
    several ranks built after its commit, or one written on demand for a save that
    wrote none (#46, :mod:`objckpt.format.commit`). With no size or CRC32C recorded
    for it, it must be there where the save wrote one (``required``: stock DCP
    readers need it; otherwise None when it is not) and name the manifest's
    ``attempt`` (its save id and its objects' names hold it): a ``.metadata`` left by
    another attempt is reported. Its bytes are never unpickled (bucket contents are
    untrusted)."""
    tail = b""
    found = False
    needle = attempt.encode()

    def search(chunk: bytes) -> None:
        nonlocal tail, found
        if not found:
            found = needle in tail + chunk[: len(needle)] or needle in chunk
            tail = chunk[-(len(needle) - 1) :] if len(needle) > 1 else b""

    try:
        size, crc = stream_object(store, METADATA_KEY, search, progress)
    except FileNotFoundError:
        if not required:
            return None
        return ObjectCheck(
            METADATA_KEY,
            0,
            "",
            None,
            None,
            "missing: the save writes it after its commit and never did (stock DCP "
            "readers cannot load this step; objckpt's readers can)",
        )
    problem = None
    if not found:
        problem = f"does not name this checkpoint's attempt {attempt}: another save's"
    return ObjectCheck(METADATA_KEY, size, crc, size, crc, problem)


def unnamed_metadata_entry(src: ObjectStore, attempt: str) -> ObjectEntry | bool | None:
    """The entry a copy or a replica of ``src`` must hold for a ``.metadata`` the
    manifest does not name (written after the source's commit, or on demand, #46): its
    size and CRC32C as the read that checked it found them, where it names ``attempt``;
    None where it is not there or names another attempt (logged); False where it
    could not be read (logged). A copy is not refused for want of what only stock
    readers use: it then leaves the destination's ``.metadata`` as it is (it may be
    this very checkpoint's, where the copy resumes one that got that far)."""
    where = src.location.url_of(METADATA_KEY)
    try:
        if not src.exists(METADATA_KEY):
            return None
        check = unnamed_metadata_check(src, attempt, required=False)
    except (StoreError, OSError) as exc:
        logger.warning(
            "%s is not copied (nor waited for in a replica): it could not be read (%s)", where, exc
        )
        return False
    if check is None:  # gone since
        return None
    if check.problem is not None:
        logger.warning("%s is not copied (nor waited for in a replica): %s", where, check.problem)
        return None
    return ObjectEntry(METADATA_KEY, check.size, check.crc32c)


@dataclasses.dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_checkpoint` did.

    Attributes:
        copied: False when ``dst`` already held this very checkpoint (same attempt).
        server_side: Objects the provider copied itself (no bytes through this host).
        streamed: Objects read here and written to ``dst``.
    """

    src: str
    dst: str
    manifest: Manifest
    copied: bool
    server_side: int
    streamed: int


def check_backup_copy(
    backup: Location, manifest: Manifest, *, parallel: int = 4
) -> tuple[ObjectCheck, ...] | str:
    """Whether ``backup`` holds the checkpoint ``manifest`` describes, object by
    object: a store-kept CRC32C where there is one, else the bytes read back.

    Returns the checks, or a string saying why there is nothing to check yet
    (no manifest, a different attempt).
    """
    store = open_store(backup)
    try:
        try:
            theirs = read_manifest(store)
        except FileNotFoundError:
            return f"no {MANIFEST_KEY} at {backup.url} yet"
        except ManifestError as exc:
            return f"{backup.url}: {exc}"
        if theirs.attempt != manifest.attempt:
            return f"{backup.url} holds attempt {theirs.attempt}, not {manifest.attempt}"
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            return tuple(
                pool.map(
                    lambda e: digest_check(store, e, None, source="the primary"), manifest.objects
                )
            )
    finally:
        store.close()


def copy_checkpoint(
    src: Location,
    dst: Location,
    *,
    manifest: Manifest | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    parallel: int = 4,
    upload: UploadOptions | None = None,
) -> CopyReport:
    """Copy a committed checkpoint; the manifest is written last, create-only.

    Objects go server-side where both ends are one provider reachable with the
    same options (S3 CopyObject/UploadPartCopy, GCS rewrite), checked by the
    CRC32C the provider computes of the copy; otherwise they stream through this
    host, checked while they stream. Either way a corrupt source never produces a
    committed copy. ``manifest`` is the source's, when the caller has read it.
    A destination already holding the same attempt is left as it is. ``upload``
    sizes the parts of streamed and server-side multipart copies.

    A source that reuses objects of earlier steps (references, :mod:`objckpt.format.refs`)
    is copied whole into a step directory ``<root>/step-<N>``: the objects it
    references go to the same step directories of that root (unless already there),
    so the copy loads, verifies and is backed up on its own. Anywhere else the
    references would point at directories that are no steps, and the copy is refused.

    Raises:
        ConfigurationError: ``src`` references other steps and ``dst`` is not a step
            directory (the message names the steps).
        CheckpointNotFoundError, CheckpointNotCommittedError: at ``src``.
        CheckpointExistsError: ``dst`` holds a different committed checkpoint
            (and ``overwrite`` is False).
        IntegrityError: A source object fails its check (nothing committed at ``dst``).
    """
    src_store = open_store(src)
    dst_store = open_store(dst, upload or UploadOptions())
    try:
        manifest = manifest or open_manifest(src_store)
        _require_step_dir(src, dst, manifest)
        if dst_store.exists(MANIFEST_KEY):
            with contextlib.suppress(ManifestError, FileNotFoundError):
                if read_manifest(dst_store).attempt == manifest.attempt:
                    logger.info("%s already holds this checkpoint (same attempt)", dst.url)
                    return CopyReport(src.url, dst.url, manifest, False, 0, 0)
            if not overwrite:
                raise CheckpointExistsError(
                    f"{dst.url} already holds a committed checkpoint; pass overwrite to replace it"
                )
        server_side = commit_copy(src_store, dst_store, manifest, progress, parallel, overwrite)
    finally:
        src_store.close()
        dst_store.close()
    streamed = len(manifest.objects) - server_side
    logger.info(
        "copied %s to %s (%d objects server-side, %d streamed)",
        src.url,
        dst.url,
        server_side,
        streamed,
    )
    return CopyReport(src.url, dst.url, manifest, True, server_side, streamed)


def _require_step_dir(src: Location, dst: Location, manifest: Manifest) -> None:
    """Refuse to copy a step with references anywhere but into a step directory, and
    one with spread keys anywhere but into a step directory of the same name: its
    ``.metadata`` names those objects by their step (``../spread-3f/step-<N>/…``),
    and a stock reader of the copy would read another step's objects of that name."""
    name, dst_name = src.url.rsplit("/", 1)[-1], dst.url.rsplit("/", 1)[-1]
    spread = any(names_spread(o.key) for o in manifest.objects)
    if spread and (dst_name != name or not holds_spread(dst)):
        raise ConfigurationError(
            f"{src.url} was saved with persistent prefixes (UploadOptions("
            f"persistent_prefixes=True)) and its .metadata names its objects by its step "
            f"{name}: copy it into a step directory of the same name under a root, e.g. "
            f"{dst.url.rsplit('/', 1)[0]}/{name}; nothing was copied"
        )
    steps = sorted({s for o in manifest.objects if (s := referenced_step(o.key)) is not None})
    if not steps or parse_step(dst_name) is not None:
        return
    raise ConfigurationError(
        f"{src.url} reuses objects stored by {', '.join(steps)} of its root, and "
        f"{dst.url} is not a step directory (<root>/step-<N>): copy it into one, e.g. "
        f"{dst.url}/{src.url.rsplit('/', 1)[-1]}; the objects it references are then "
        "copied into that root's step directories of the same names, and the copy is "
        "whole on its own; nothing was copied"
    )


def commit_copy(
    src: ObjectStore,
    dst: ObjectStore,
    manifest: Manifest,
    progress: Progress | None,
    parallel: int,
    overwrite: bool,
    objects: tuple[ObjectEntry, ...] | None = None,
) -> int:
    """Copy ``objects`` (default: every object but ``.metadata``), check with one
    listing that all the manifest names but ``.metadata`` is at ``dst``, write the
    manifest (settled by read-back), then copy ``.metadata``, or, where the source
    has none (a save above ``stock_metadata_max_ranks``, a failed step 4), delete
    the destination's: a stock reader must not load another checkpoint at ``dst``
    than its manifest. Returns how many objects went server-side.

    ``.metadata`` has a fixed name, so writing it before the commit would change a
    committed destination's even when this copy then fails or loses.

    An object already at ``dst`` with the same size and CRC32C is not copied again (a
    copy resumed after a failure), one with other bytes is refused, and no object
    that was there before is ever overwritten. With ``overwrite``, after the commit
    (and ``.metadata``), the objects only the replaced manifest named are deleted, as
    after an overwriting save, but for those another step of ``dst``'s root
    references (:func:`~objckpt.format.superseded.delete_superseded_after`).

    Objects the step references in sibling step directories (``../step-<N>/<key>``)
    go to the same root-relative key beside ``dst`` unless that key already holds
    them (same size and CRC32C: the usual case, an earlier step copied them), so the
    manifest and index objects are copied unchanged and the target step is whole on
    its own; they are checked like the step's own (one listing per referenced step
    directory) right before the manifest PUT.

    Raises:
        CheckpointExistsError: Another manifest won at ``dst``.
        UploadError: An object is missing at ``dst`` before the commit.
        IntegrityError: An object at ``dst`` (or a referenced one at ``dst``'s root)
            has other bytes than the manifest records (never overwritten; nothing
            committed).
    """
    rest = [e for e in manifest.objects if e.key != METADATA_KEY and not is_reference(e.key)]
    refs = [e for e in manifest.objects if is_reference(e.key)]
    picked = manifest.objects if objects is None else objects
    # What the manifest this copy replaces names: deleted after the commit, as an
    # overwriting save does (format/superseded.py decides what is safe to delete).
    superseded = previous_objects(dst) if overwrite else set()
    todo = [e for e in picked if e.key != METADATA_KEY and not is_reference(e.key)]
    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        # Whatever is there already is never overwritten (nor deleted after a failed
        # check): a committed step of the destination's root may reference it.
        held = list(pool.map(lambda e: holds_reference(dst, e), todo + refs))
        lacking = [e for e, there in zip(todo + refs, held, strict=True) if not there]
        futures = [pool.submit(copy_object, src, dst, e, progress, fresh=True) for e in lacking]
        server_side = sum(bool(f.result()) for f in futures)
    if len(lacking) < len(todo) + len(refs):
        logger.info(
            "copied %d objects to %s (%d were there already, checked)",
            len(lacking),
            dst.location.url,
            len(todo) + len(refs) - len(lacking),
        )
    metadata: ObjectEntry | bool | None = manifest.object(METADATA_KEY)
    if metadata is None:  # checked here, before the commit: nothing raises after it
        metadata = unnamed_metadata_entry(src, manifest.attempt)
    require_present(dst, rest)
    require_referenced(dst, refs)
    put_manifest(dst, manifest.to_json_bytes(), overwrite=overwrite)
    copied: list[bool] = []
    doomed = superseded - {e.key for e in manifest.objects}
    if isinstance(metadata, ObjectEntry):
        entry = metadata

        def copy_metadata() -> None:
            copied.append(copy_object(src, dst, entry, progress))

        finish_commit(dst, f"copying {METADATA_KEY}", copy_metadata, doomed)
    elif metadata is None:  # none to copy: none of another checkpoint's stays either
        finish_without_metadata(dst, doomed)
    else:  # the source's could not be read: the destination's is left as it is
        finish_commit(dst, f"copying {METADATA_KEY}", None, doomed)
    return server_side + sum(copied)
