"""Deleting steps and collecting garbage under a root.

Deleting a committed step removes its manifest first: from that moment the step
is gone for every reader (a checkpoint exists iff its manifest exists), and
whatever is left if the deletion stops half-way is ordinary garbage for ``gc``.

Garbage is every object in a step directory that no committed manifest names:
payloads of failed saves, of a zombie writer whose attempt lost, the
``.metadata`` of a step that never committed. Anything younger than the grace
period is spared, because a save in flight looks exactly like that until it
commits; so are multipart uploads opened less than the grace period ago.
Objects outside step directories are never touched (the root may hold things
that are not objckpt's), with one exception: when the root is itself a checkpoint
(a URL saved to directly, not through a manager), objects only objckpt writes
(payloads, index objects) at its top that its committed manifest does not name
are garbage too: a failed save's, or an overwritten attempt's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable

from objckpt.errors import CheckpointNotFoundError, ConfigurationError, ManifestError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_entropy_dir, is_objckpt_object
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import ObjectInfo, StepInfo, inventory, parse_step, step_name, steps_of
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, OpenUpload, open_store
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = ["DEFAULT_GRACE", "GcReport", "collect_garbage", "delete_step"]

logger = logging.getLogger(__name__)

#: Seconds an unreferenced object or open upload is spared (a save may be in flight):
#: an hour, and never less than the default save deadline, so that with the defaults
#: gc cannot collect a save that is still allowed to run. A promotion has no deadline
#: of its own; a grace shorter than a save or promotion makes that save fail at its
#: commit (the commit lists its objects first, :mod:`objckpt.format.settle`), never
#: commit a manifest that names deleted objects.
DEFAULT_GRACE = max(3600.0, UploadOptions().deadline or 0.0)


@dataclasses.dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or, in a dry run, would remove).

    Attributes:
        deleted: Keys relative to the root.
        bytes_reclaimed: Their total size.
        aborted_uploads: Keys of the multipart uploads aborted.
        spared: Unreferenced keys younger than the grace period (kept).
        spared_uploads: Keys of open uploads active within the grace period (kept).
        unreadable_steps: Steps whose manifest could not be read; nothing in them
            was touched.
    """

    root: str
    dry_run: bool
    deleted: tuple[str, ...]
    bytes_reclaimed: int
    aborted_uploads: tuple[str, ...]
    spared: tuple[str, ...]
    spared_uploads: tuple[str, ...]
    unreadable_steps: tuple[int, ...]


def _referenced(store: ObjectStore, steps: list[StepInfo]) -> tuple[set[str], list[int]]:
    """Keys (relative to the root) named by committed manifests; steps we cannot read."""
    keep: set[str] = set()
    unreadable: list[int] = []
    for s in steps:
        if not s.committed:
            continue
        name = step_name(s.step)
        step_store = open_store(store.location.child(name), store.options, store.fs)
        try:
            manifest = read_manifest(step_store)
        except (ManifestError, FileNotFoundError) as exc:
            logger.warning("gc leaves %s alone: its manifest is unreadable (%s)", s.url, exc)
            unreadable.append(s.step)
            continue
        keep.update(f"{name}/{k}" for k in (MANIFEST_KEY, METADATA_KEY))
        keep.update(f"{name}/{o.key}" for o in manifest.objects)
    return keep, unreadable


def _own_checkpoint(store: ObjectStore, objects: list[ObjectInfo]) -> frozenset[str] | None:
    """When ``root`` is itself one checkpoint (``gc s3://b/ckpt`` on a checkpoint
    saved outside a manager): the keys its committed manifest names (empty when it
    has none). None when that manifest cannot be read (nothing is touched then)."""
    if not any(o.key == MANIFEST_KEY for o in objects):
        return frozenset()
    try:
        manifest = read_manifest(store)
    except (ManifestError, FileNotFoundError) as exc:
        logger.warning(
            "gc leaves %s alone: its manifest is unreadable (%s)", store.location.url, exc
        )
        return None
    return frozenset({MANIFEST_KEY, METADATA_KEY, *(o.key for o in manifest.objects)})


def _in_own_checkpoint(key: str, named: frozenset[str]) -> bool:
    """An object at the root's top (or in an entropy sub-prefix) that only objckpt
    writes and the root's own manifest does not name: a failed or superseded save's."""
    head, sep, _ = key.partition("/")
    if sep and not is_entropy_dir(head):
        return False
    return key not in named and is_objckpt_object(key)


def collect_garbage(
    root: Location,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = True,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> GcReport:
    """Find (and unless ``dry_run``, delete) garbage under ``root``.

    Args:
        grace: Seconds; younger unreferenced objects and uploads are spared.
        progress: Called with the number of objects handled, as deletion goes.

    Raises:
        StoreError: Listing or deleting failed (named for the root or object).
    """
    if not (isinstance(grace, (int, float)) and grace >= 0):
        raise ValueError(f"grace must be seconds >= 0, got {grace!r}")
    now = time.time() if now is None else now
    store = open_store(root)
    try:
        objects = inventory(store.fs, root)
        steps = steps_of(objects, root)
        keep, unreadable = _referenced(store, steps)
        skip_dirs = {step_name(s) + "/" for s in unreadable}
        own = _own_checkpoint(store, objects)  # None: unreadable, its objects left alone
        garbage: list[ObjectInfo] = []
        spared: list[str] = []
        for obj in objects:
            head, sep, _ = obj.key.partition("/")
            if obj.key in keep:
                continue  # named by a committed manifest
            in_step = bool(sep) and parse_step(head) is not None
            if not in_step and not (own is not None and _in_own_checkpoint(obj.key, own)):
                continue  # not objckpt's to judge: outside step directories
            if any(obj.key.startswith(d) for d in skip_dirs):
                continue
            if obj.modified is None or now - obj.modified < grace:
                spared.append(obj.key)
            else:
                garbage.append(obj)
        uploads: list[OpenUpload] = []
        young_uploads: list[OpenUpload] = []
        for u in store.open_uploads():
            stale = u.last_activity is not None and now - u.last_activity >= grace
            (uploads if stale else young_uploads).append(u)
        if not dry_run:
            _delete(store, [o.key for o in garbage], progress)
            for u in uploads:
                store.abort_upload(u)
            gone = {o.key for o in garbage}
            left = {o.key.split("/", 1)[0] for o in objects} - {
                o.key.split("/", 1)[0] for o in objects if o.key not in gone
            }
            for name in left:  # step directories emptied by this run
                if parse_step(name) is not None:
                    _prune(store, root.child(name))
        report = GcReport(
            root=root.url,
            dry_run=dry_run,
            deleted=tuple(o.key for o in garbage),
            bytes_reclaimed=sum(o.size for o in garbage),
            aborted_uploads=tuple(u.key for u in uploads),
            spared=tuple(spared),
            spared_uploads=tuple(u.key for u in young_uploads),
            unreadable_steps=tuple(unreadable),
        )
    finally:
        store.close()
    logger.info(
        "gc %s%s: %d objects (%d bytes), %d open uploads, %d objects and %d uploads spared",
        root.url,
        " (dry run)" if dry_run else "",
        len(report.deleted),
        report.bytes_reclaimed,
        len(report.aborted_uploads),
        len(report.spared),
        len(report.spared_uploads),
    )
    return report


def _delete(
    store: ObjectStore, keys: list[str], progress: Callable[[int], None] | None = None
) -> None:
    """Delete keys (relative to the store's location), in batches."""
    batch = 500
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        try:
            store.fs.rm([store.path(k) for k in chunk])
        except FileNotFoundError:
            for k in chunk:  # some were gone already: delete the rest one by one
                with contextlib.suppress(FileNotFoundError):
                    store.fs.rm(store.path(k))
        except Exception as exc:
            raise translate(exc, url=store.location.url_of(chunk[0]), action="deleting") from exc
        if progress is not None:
            progress(len(chunk))
    store.fs.invalidate_cache(store.location.path)


def _prune(store: ObjectStore, location: Location) -> None:
    """Remove an emptied directory on a local filesystem (object stores have none)."""
    if location.is_local:
        with contextlib.suppress(OSError):
            for name in os.listdir(location.path):  # emptied prefix-entropy directories
                if is_entropy_dir(name):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(location.path, name))
            store.fs.rmdir(location.path)


def delete_step(location: Location, store: ObjectStore | None = None) -> int:
    """Delete the checkpoint at ``location``: manifest first, then everything else.

    Returns the number of objects removed. Open multipart uploads under it are
    aborted too.

    Raises:
        CheckpointNotFoundError: Nothing is stored at ``location``.
    """
    own = store is None
    store = store or open_store(location)
    try:
        names = [o.key for o in inventory(store.fs, location)]
        uploads: list[OpenUpload] = store.open_uploads()
        if not names and not uploads:
            raise CheckpointNotFoundError(f"no checkpoint at {location.url}")
        nested = [
            n
            for n in names
            if "/" in n and not (is_entropy_dir(n.split("/")[0]) and n.count("/") == 1)
        ]
        if nested:
            raise ConfigurationError(
                f"{location.url} is not one checkpoint: it holds {location.url_of(nested[0])}; "
                "deleting removes a single checkpoint, never a tree"
            )
        ours = {MANIFEST_KEY, METADATA_KEY}
        strangers = [n for n in names if n not in ours and not is_objckpt_object(n)]
        if strangers and MANIFEST_KEY not in names:
            raise ConfigurationError(
                f"{location.url} does not look like an objckpt checkpoint "
                f"(no {MANIFEST_KEY}; holds {strangers[0]}); nothing was deleted"
            )
        if MANIFEST_KEY in names:  # uncommit in one request before anything else goes
            _delete(store, [MANIFEST_KEY])
        _delete(store, [n for n in names if n != MANIFEST_KEY])
        for u in uploads:
            store.abort_upload(u)
        _prune(store, location)
        logger.info("deleted %s (%d objects)", location.url, len(names))
        return len(names)
    finally:
        if own:
            store.close()
