"""Deleting steps of a root whose steps may reference each other's bytes.

A step is deleted in two moves, as it always was: its ``manifest.json`` first (from
that moment the step is gone for every reader), then its ``.metadata``, then its
objects. With reuse (:mod:`objckpt.format.refs`) a later step's manifest may name
objects this step's directory stores, so the third move deletes only what the
root's live set (:mod:`objckpt.ops.maintain.live_set`) does not hold: objects still
referenced stay where they are, in a directory that is no step any more (it has no
manifest, so no listing of steps names it), until the last step referencing them
goes. That last deletion also removes what it referenced and nothing else needs
(the objects left behind in such manifest-less directories), so a run with
``keep_last`` does not accumulate them between ``gc`` runs.

What the doomed steps referenced comes from a listing taken before the first
deletion; what stays comes from a second listing taken after their manifests are
deleted, and the manifests it shows (cached by the caller where it deletes often):
a step that committed in between, referencing the doomed step's bytes, keeps them.
Objects outside the retired directories (what the doomed steps referenced in
directories left without a manifest) are deleted only once older than the grace
period, as gc would. A save of another process that references the bytes
concerned and has not committed is protected by its index objects for the grace
period; one that commits anyway after its bytes went fails at its commit (the
commit lists every referenced object right before its create-only manifest PUT),
never commits a dangling reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from objckpt.errors import CheckpointNotFoundError, ConfigurationError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_entropy_dir, is_objckpt_object
from objckpt.format.steps import ObjectInfo, parse_step, step_name
from objckpt.ops.maintain.live_set import DEFAULT_GRACE, ManifestCache, live_set, step_dir_of
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location, is_spread_dir, unplaced

__all__ = ["RetireReport", "delete_keys", "parent_root", "prune_dir", "retire_steps"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetireReport:
    """What :func:`retire_steps` did.

    Attributes:
        root: The root's URL.
        steps: The steps uncommitted (their manifests deleted), ascending.
        deleted: Root-relative keys deleted (manifests included).
        kept: Root-relative keys of the retired steps' directories kept because a
            committed step or a save in flight still references them.
    """

    root: str
    steps: tuple[int, ...]
    deleted: tuple[str, ...]
    kept: tuple[str, ...]


def parent_root(location: Location) -> tuple[Location, int] | None:
    """``(root, step)`` when ``location`` is a step directory ``<root>/step-<N>``."""
    head, sep, name = location.url.rpartition("/")
    step = parse_step(name)
    if not sep or step is None or "/" not in location.path:
        return None
    path = location.path.rpartition("/")[0]
    return dataclasses.replace(location, url=head, path=path), step


def retire_steps(
    root: Location,
    steps: Iterable[int],
    *,
    grace: float = DEFAULT_GRACE,
    cache: ManifestCache | None = None,
    now: float | None = None,
    store: ObjectStore | None = None,
    require: bool = False,
) -> RetireReport:
    """Delete ``steps`` under ``root``: manifests first, then what nothing else needs.

    Args:
        grace: Seconds an uncommitted index object protects what it references.
        cache: Manifest keys read before (:data:`objckpt.ops.maintain.live_set.ManifestCache`).
        require: Raise when a step has nothing stored, or holds objects that are not
            objckpt's and no manifest (``rm`` of one step).

    Raises:
        CheckpointNotFoundError: ``require`` and nothing is stored for a step.
        ConfigurationError: ``require`` and a step directory does not look like an
            objckpt checkpoint (nothing deleted).
        StoreError: Listing, reading a manifest or deleting failed; what is left is
            either still committed or garbage for ``gc``.
    """
    now = time.time() if now is None else now
    cache = {} if cache is None else cache  # the two passes below read each manifest once
    doomed = sorted(set(steps))
    own = store is None
    store = store or open_store(root)
    try:
        objects = store.at(root).inventory()
        by_dir: dict[str, list[ObjectInfo]] = {}
        for o in objects:
            d = step_dir_of(o.key)
            if d is not None:
                by_dir.setdefault(d, []).append(o)
        dirs = [step_name(s) for s in doomed]
        if require:
            _require(root, dirs, by_dir)
        # What the doomed manifests referenced elsewhere (to sweep if nothing else needs it).
        before = live_set(store, objects, grace=grace, now=now, cache=cache)
        referenced = {k for k, by in before.referrers.items() if set(by) & set(dirs)}
        deleted: list[str] = []
        for d in dirs:  # uncommit each step in one request, before anything else goes
            for name in (MANIFEST_KEY, METADATA_KEY):
                key = f"{d}/{name}"
                if any(o.key == key for o in by_dir.get(d, ())):
                    delete_keys(store, [key])
                    deleted.append(key)
        # A fresh listing, taken now that the doomed manifests are gone: a step that
        # committed since the first one (referencing what is about to go) is in it.
        fresh = store.at(root).inventory()
        live = live_set(store, fresh, grace=grace, now=now, exclude=dirs, cache=cache)
        gone = set(deleted)
        candidates = [o.key for d in dirs for o in by_dir.get(d, ()) if o.key not in gone]
        present = {o.key: o for o in fresh}
        committed = {
            d for o in fresh if (d := step_dir_of(o.key)) is not None and _is_manifest(o, d)
        }
        # Outside the retired directories only what is older than the grace: a
        # damaged or crafted manifest must not get a save in flight's payload deleted.
        candidates += sorted(
            k
            for k in referenced
            if k in present
            and step_dir_of(k) not in committed
            and step_dir_of(k) not in dirs
            and _older(present[k], grace, now)
        )
        if live.partial:
            kept = candidates
            logger.warning(
                "retiring steps %s of %s deleted their manifests only: the live set is "
                "partial (unreadable manifests of steps %s or index objects %s)",
                doomed,
                root.url,
                list(live.unreadable),
                list(live.unreadable_indexes),
            )
        else:
            kept = [k for k in candidates if k in live]
            doomed_keys = [k for k in candidates if k not in live]
            delete_keys(store, doomed_keys)
            deleted += doomed_keys
        _abort_uploads(store, dirs)
        for d in {*dirs, *(step_dir_of(k) for k in deleted)}:
            if d is not None:
                prune_dir(store, root.child(d))
    finally:
        if own:
            store.close()
    kept = sorted(set(kept))
    if kept:
        logger.info(
            "retired steps %s of %s; kept %d of their objects that later steps reference",
            doomed,
            root.url,
            len(kept),
        )
    return RetireReport(root.url, tuple(doomed), tuple(deleted), tuple(kept))


def _older(o: ObjectInfo, grace: float, now: float) -> bool:
    """Whether ``o`` is older than ``grace`` (an object of unknown age never is)."""
    return o.modified is not None and now - o.modified >= grace


def _is_manifest(o: ObjectInfo, step_dir: str) -> bool:
    return o.key == f"{step_dir}/{MANIFEST_KEY}"


def delete_keys(
    store: ObjectStore, keys: list[str], progress: Callable[[int], None] | None = None
) -> None:
    """Delete keys (relative to the store's location), in batches."""
    batch = 500
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        store.delete_many(chunk)
        if progress is not None:
            progress(len(chunk))
    store.forget_listings()


def prune_dir(store: ObjectStore, location: Location) -> None:
    """Remove an emptied directory on a local filesystem, with the prefix-entropy
    directories emptied inside it, and a step directory's emptied shares of the
    root's spread directories (object stores have no directories). The spread
    directories stay: a save may be about to write into one."""
    if not location.is_local:
        return
    here = store.at(location)
    with contextlib.suppress(OSError):
        here.remove_empty_directories(n for n in here.directories() if is_entropy_dir(n))
    if parse_step(location.url) is None:
        return
    root = location.parent()
    with contextlib.suppress(OSError):
        for d in store.at(root).directories():
            if is_spread_dir(d):  # its share of the step; the spread directory persists
                store.at(
                    root.child(f"{d}/{location.url.rsplit('/')[-1]}")
                ).remove_empty_directories()


def _require(root: Location, dirs: list[str], by_dir: dict[str, list[ObjectInfo]]) -> None:
    for d in dirs:
        names = [where[1] for o in by_dir.get(d, ()) if (where := unplaced(o.key)) is not None]
        url = root.child(d).url
        if not names:
            raise CheckpointNotFoundError(f"no checkpoint at {url}")
        nested = [n for n in names if "/" in n and not is_entropy_dir(n.split("/")[0])]
        nested += [n for n in names if n.count("/") > 1]
        if nested:
            raise ConfigurationError(
                f"{url} is not one checkpoint: it holds {root.child(d).url_of(nested[0])}; "
                "deleting removes a single checkpoint, never a tree"
            )
        strangers = [
            n for n in names if n not in (MANIFEST_KEY, METADATA_KEY) and not is_objckpt_object(n)
        ]
        if strangers and MANIFEST_KEY not in names:
            raise ConfigurationError(
                f"{url} does not look like an objckpt checkpoint (no {MANIFEST_KEY}; holds "
                f"{strangers[0]}); nothing was deleted"
            )


def _abort_uploads(store: ObjectStore, dirs: list[str]) -> None:
    """Abort the open multipart uploads under the retired step directories."""
    for u in store.open_uploads():
        if step_dir_of(u.key) in dirs:
            store.abort_upload(u)
