"""The live set of a root: every object some committed step, or a save in flight, needs.

A step saved with reuse (:mod:`objckpt.format.refs`) names objects another step
directory stores, so "the objects under a step's directory" and "the objects a step
needs" are no longer the same set. Deleting a step (retention, ``rm``,
``discard_after``) or collecting garbage therefore decides per object, from the whole
root: an object stays while any committed manifest of the root names it (each
manifest's keys made root-relative with :func:`~objckpt.format.refs.root_key`), or
while an uncommitted index object younger than the grace period references it (a
save of another process that reuses it and has not committed yet).

What is safe when a manifest cannot be read: nothing that a manifest could name is
collected. An unreadable manifest (corrupt, or written by a newer objckpt) may
reference any sibling's objects, so while one exists the live set is *partial* and
deletions remove manifests (uncommitting steps) but no payloads or index objects;
they stay garbage for a later ``gc`` once the manifest is readable or gone.

Committed manifests never change while committed, so a caller that deletes often
(the manager's retention after every save) passes a cache of each manifest's keys,
keyed by the listing's (key, size, time) of the manifest: a listing plus the
manifests committed since the last pass, not every manifest each time. What an
uncommitted index object references is cached the same way (index objects are
written once, under their save's attempt id).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, MutableMapping

from objckpt.errors import ManifestError
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES, load_json
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, index_rank, is_objckpt_object
from objckpt.format.manifest import Manifest, read_manifest
from objckpt.format.refs import is_reference, root_key, split_reference
from objckpt.format.steps import ObjectInfo, parse_step
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore
from objckpt.writers.location import unplaced

__all__ = [
    "DEFAULT_GRACE",
    "LiveSet",
    "ManifestCache",
    "live_set",
    "manifest_keys",
    "step_dir_of",
]

logger = logging.getLogger(__name__)

#: Seconds an unreferenced object, open upload or uncommitted index object is spared
#: (a save may be in flight): an hour, and never less than the default save deadline,
#: so that with the defaults gc cannot collect a save that is still allowed to run. A
#: promotion has no deadline of its own; a grace shorter than a save or promotion
#: makes that save fail at its commit (the commit lists its objects, and every object
#: it references, first: :mod:`objckpt.format.settle`), never commit a manifest that
#: names deleted objects.
DEFAULT_GRACE = max(3600.0, UploadOptions().deadline or 0.0)

#: Root-relative keys a committed manifest names, keyed by its listing entry.
ManifestCache = MutableMapping[tuple[str, int, float | None], frozenset[str]]


@dataclasses.dataclass(frozen=True)
class LiveSet:
    """What must stay under a root.

    Attributes:
        root: The root's URL.
        named: Root-relative keys named by committed manifests (their own
            ``manifest.json`` and ``.metadata`` included).
        pending: Root-relative keys referenced by uncommitted index objects younger
            than the grace period (saves in flight elsewhere).
        unreadable: Committed steps whose manifest could not be read; while there is
            one, :attr:`partial` is True.
        unreadable_indexes: Root-relative keys of young uncommitted index objects
            that could not be read (too large, malformed): what they reference is
            unknown, so :attr:`partial` is True too.
        referrers: For each referenced key (another step's object), the step
            directories whose manifests reference it (for messages).
    """

    root: str
    named: frozenset[str]
    pending: frozenset[str]
    unreadable: tuple[int, ...]
    unreadable_indexes: tuple[str, ...] = ()
    referrers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def partial(self) -> bool:
        """Whether some committed manifest could not be read (collect no payloads)."""
        return bool(self.unreadable or self.unreadable_indexes)

    def __contains__(self, key: object) -> bool:
        return key in self.named or key in self.pending


def step_dir_of(key: str) -> str | None:
    """The step directory whose object a root-relative key is (in it, or in front of
    it in a spread directory: :func:`~objckpt.writers.location.placed`), or None
    outside step directories (and for anything in a spread directory that is not
    objckpt's: it is left alone)."""
    where = unplaced(key)
    if where is None or (key.startswith("spread-") and not is_objckpt_object(key)):
        return None  # only objckpt's payloads are ever stored in a spread directory
    return where[0]


def manifest_keys(step_dir: str, manifest: Manifest) -> frozenset[str]:
    """Every root-relative key a step's manifest keeps alive (itself included)."""
    keys = {f"{step_dir}/{MANIFEST_KEY}", f"{step_dir}/{METADATA_KEY}"}
    keys.update(root_key(step_dir, o.key) for o in manifest.objects)
    return frozenset(keys)


def live_set(
    store: ObjectStore,
    objects: Iterable[ObjectInfo],
    *,
    grace: float,
    now: float,
    exclude: Iterable[str] = (),
    cache: ManifestCache | None = None,
) -> LiveSet:
    """The live set of the root ``store`` is at, from one listing of it (``objects``).

    Args:
        objects: The root's inventory (:meth:`objckpt.writers.base.ObjectStore.inventory`).
        grace: Seconds; uncommitted index objects younger than this (or of unknown
            age) protect what they reference.
        now: The time the ages are measured at.
        exclude: Step directories whose manifests and index objects do not count
            (steps being deleted).
        cache: Keys of manifests read before (see :data:`ManifestCache`).

    Raises:
        StoreError: Reading a manifest failed for another reason than its content.
    """
    objects = list(objects)
    skip = set(exclude)
    committed = {
        o.key.split("/", 1)[0]: o
        for o in objects
        if o.key.endswith("/" + MANIFEST_KEY)
        and o.key.count("/") == 1
        and step_dir_of(o.key) is not None
        and o.key.split("/", 1)[0] not in skip
    }
    named: set[str] = set()
    unreadable: list[int] = []
    referrers: dict[str, list[str]] = {}
    for step_dir, info in sorted(committed.items()):
        keys = _manifest_keys(store, step_dir, info, cache)
        if keys is None:
            unreadable.append(parse_step(step_dir) or 0)
            continue
        named.update(keys)
        for key in keys:
            if step_dir_of(key) != step_dir:
                referrers.setdefault(key, []).append(step_dir)
    pending: set[str] = set()
    bad_indexes: list[str] = []
    for o in objects:
        where = step_dir_of(o.key)
        if where is None or where in skip or index_rank(o.key) is None or o.key in named:
            continue  # (the index objects of the steps being deleted protect nothing)
        if o.modified is not None and now - o.modified >= grace:
            continue  # an index object no save in flight can own any more
        refs = _index_references(store, where, o, cache)
        if refs is None:
            bad_indexes.append(o.key)
        else:
            pending.update(refs)
    return LiveSet(
        root=store.location.url,
        named=frozenset(named),
        pending=frozenset(pending),
        unreadable=tuple(unreadable),
        unreadable_indexes=tuple(bad_indexes),
        referrers={k: tuple(v) for k, v in referrers.items()},
    )


def _manifest_keys(
    store: ObjectStore, step_dir: str, info: ObjectInfo, cache: ManifestCache | None
) -> frozenset[str] | None:
    """A committed manifest's live keys (None when it cannot be read)."""
    cache_key = (info.key, info.size, info.modified)
    if cache is not None and cache_key in cache:
        return cache[cache_key]
    step_store = store.child(step_dir)
    try:
        manifest = read_manifest(step_store)
    except (ManifestError, FileNotFoundError) as exc:
        logger.warning(
            "the live set of %s is partial: the manifest of %s is unreadable (%s); no "
            "payloads are collected while it is",
            store.location.url,
            step_store.location.url,
            exc,
        )
        return None
    keys = manifest_keys(step_dir, manifest)
    if cache is not None and info.modified is not None:
        cache[cache_key] = keys
    return keys


def _index_references(
    store: ObjectStore, step_dir: str, info: ObjectInfo, cache: ManifestCache | None
) -> frozenset[str] | None:
    """Root-relative keys an uncommitted index object references in other step
    directories; None when it cannot be read within the metadata cap (what it
    references is unknown then, and the caller collects no payloads).

    An index object is written once (its key names the save's attempt), so what it
    references is cached like a manifest's keys, by its listing entry: a failed
    save's index objects are read once, not by every retention pass of the grace
    period (at 1,024 ranks, 1,024 GETs a pass)."""
    cache_key = (info.key, info.size, info.modified)
    if cache is not None and cache_key in cache:
        return cache[cache_key]
    refs = _read_index_references(store, step_dir, info)
    if refs is not None and cache is not None and info.modified is not None:
        cache[cache_key] = refs
    return refs


def _read_index_references(
    store: ObjectStore, step_dir: str, info: ObjectInfo
) -> frozenset[str] | None:
    url = store.location.url_of(info.key)
    if info.size > DEFAULT_MAX_METADATA_BYTES:
        logger.warning(
            "the live set of %s is partial: %s is %d bytes, over the metadata cap %d",
            store.location.url,
            url,
            info.size,
            DEFAULT_MAX_METADATA_BYTES,
        )
        return None
    try:
        doc = load_json(store.read(info.key), what="index", url=url)
    except FileNotFoundError:
        return frozenset()  # committed or collected since the listing: protects nothing
    except ManifestError as exc:
        logger.warning(
            "the live set of %s is partial: %s is unreadable (%s)", store.location.url, url, exc
        )
        return None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    out: set[str] = set()
    for key in keys if isinstance(keys, list) else ():
        if isinstance(key, str) and is_reference(key):
            try:
                split_reference(key, url)
            except ManifestError:
                continue
            out.add(root_key(step_dir, key))
    return frozenset(out)
