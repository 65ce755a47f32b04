"""Deleting steps and collecting garbage under a root.

Deleting a committed step removes its manifest first: from that moment the step
is gone for every reader (a checkpoint exists iff its manifest exists), and
whatever is left if the deletion stops half-way is ordinary garbage for ``gc``.

Garbage is every object in a step directory that no committed manifest names:
payloads of failed saves, of a zombie writer whose attempt lost, the
``.metadata`` of a step that never committed. Anything younger than the grace
period is spared, because a save in flight looks exactly like that until it
commits; so are multipart uploads opened less than the grace period ago.
With reuse, a step's manifest may name objects another step directory stores
(:mod:`objckpt.format.refs`): what is garbage is then decided over the whole root,
from its live set (:mod:`objckpt.ops.maintain.live_set`): every object any committed manifest
names, wherever it is stored, and every object an uncommitted index object younger
than the grace references (a reusing save of another process, in flight). A step
directory left without a manifest but holding objects later steps reference is no
step (no listing of steps names it), and those objects are not garbage. While some
committed manifest cannot be read, nothing it could reference is collected (the
live set is partial): only open uploads and the objects of unreadable steps stay
as they are otherwise.

Run on one step directory of a root (``gc <root>/step-<N>``), gc also keeps every
object there that the root's live set holds: a retired step's directory keeps the
objects later steps reference, with no manifest of its own.

Objects outside step directories are never touched (the root may hold things
that are not objckpt's), with one exception: when the root is itself a checkpoint
(a URL saved to directly, not through a manager), objects only objckpt writes
(payloads, index objects) at its top that its committed manifest does not name
are garbage too: a failed save's, or an overwritten attempt's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from objckpt.errors import CheckpointNotFoundError, ConfigurationError, ManifestError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_entropy_dir, is_objckpt_object
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import ObjectInfo, step_name
from objckpt.ops.maintain.live_set import DEFAULT_GRACE, live_set, step_dir_of
from objckpt.ops.maintain.retire import delete_keys, parent_root, prune_dir, retire_steps
from objckpt.writers import ObjectStore, OpenUpload, open_store
from objckpt.writers.location import Location, is_spread_key

__all__ = ["DEFAULT_GRACE", "GcReport", "collect_garbage", "delete_step"]

logger = logging.getLogger(__name__)


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


def _parent_live(store: ObjectStore, *, grace: float, now: float) -> frozenset[str] | None:
    """When gc runs on one step directory of a root (``gc <root>/step-<N>``): the keys
    in it that the root's live set holds (later steps reference them, or a save in
    flight does; a retired step's directory keeps such objects on purpose). None
    when that live set is partial (nothing there is touched). Empty otherwise."""
    parent = parent_root(store.location)
    if parent is None:
        return frozenset()
    root, step = parent
    name = step_name(step) + "/"
    root_store = store.at(root)
    try:
        live = live_set(root_store, root_store.inventory(), grace=grace, now=now)
    finally:
        root_store.close()
    if live.partial:
        logger.warning(
            "gc leaves %s alone: the live set of its root %s is partial",
            store.location.url,
            root.url,
        )
        return None
    return frozenset(k[len(name) :] for k in (*live.named, *live.pending) if k.startswith(name))


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
        objects = store.inventory()
        live = live_set(store, objects, grace=grace, now=now)
        unreadable = list(live.unreadable)
        skip_dirs = {step_name(s) for s in unreadable}
        own = _own_checkpoint(store, objects)  # None: unreadable, its objects left alone
        kept_for_root = _parent_live(store, grace=grace, now=now)
        step_directory = parent_root(root) is not None
        garbage: list[ObjectInfo] = []
        spared: list[str] = []
        for obj in objects:
            if obj.key in live:
                continue  # named by a committed manifest, or by a save in flight
            if kept_for_root is None or obj.key in kept_for_root:
                continue  # a step directory's objects other steps of its root need
            if step_directory and is_spread_key(obj.key):
                continue  # in a step directory, the store places this key elsewhere
            step_dir = step_dir_of(obj.key)  # (in front of it too: a spread directory's)
            in_step = step_dir is not None
            if not in_step and not (own is not None and _in_own_checkpoint(obj.key, own)):
                continue  # not objckpt's to judge: outside step directories
            if step_dir in skip_dirs:
                continue
            if obj.modified is None or now - obj.modified < grace or (in_step and live.partial):
                spared.append(obj.key)
            else:
                garbage.append(obj)
        uploads: list[OpenUpload] = []
        young_uploads: list[OpenUpload] = []
        for u in store.open_uploads():
            stale = u.last_activity is not None and now - u.last_activity >= grace
            (uploads if stale else young_uploads).append(u)
        if not dry_run:
            delete_keys(store, [o.key for o in garbage], progress)
            for u in uploads:
                store.abort_upload(u)
            gone = {o.key for o in garbage}
            left = {step_dir_of(o.key) for o in objects} - {
                step_dir_of(o.key) for o in objects if o.key not in gone
            }
            for name in left:  # step directories emptied by this run
                if name is not None:
                    prune_dir(store, root.child(name))
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


def delete_step(location: Location, store: ObjectStore | None = None) -> int:
    """Delete the checkpoint at ``location``: manifest first, then everything else.

    Returns the number of objects removed. Open multipart uploads under it are
    aborted too. A step directory of a root (``<root>/step-<N>``) is retired over
    the root's live set (:func:`objckpt.ops.maintain.retire.retire_steps`): its objects that
    other committed steps reference stay.

    Raises:
        CheckpointNotFoundError: Nothing is stored at ``location``.
    """
    parent = parent_root(location)
    if parent is not None:
        root, step = parent
        report = retire_steps(root, [step], require=True)
        logger.info("deleted %s (%d objects)", location.url, len(report.deleted))
        return len(report.deleted)
    own = store is None
    store = store or open_store(location)
    try:
        names = [o.key for o in store.at(location).inventory()]
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
            delete_keys(store, [MANIFEST_KEY])
        delete_keys(store, [n for n in names if n != MANIFEST_KEY])
        for u in uploads:
            store.abort_upload(u)
        prune_dir(store, location)
        logger.info("deleted %s (%d objects)", location.url, len(names))
        return len(names)
    finally:
        if own:
            store.close()
