"""What an overwrite deletes of the checkpoint it replaced, and what it must keep.

Overwriting a URL deletes, after the new manifest commits and ``.metadata`` is
replaced (the commit's last step, :mod:`objckpt.format.commit`), the objects only
the replaced manifest named (:func:`delete_superseded_after`). With
reuse (:mod:`objckpt.format.refs`), when the URL is a step directory of a root,
later steps of that root may name those very objects as ``../step-<N>/<key>``:
"only the replaced manifest named them" is then a question about the whole root,
not about one manifest. This module answers it from one listing of the root and the
sibling steps' manifests (an overwrite is rare; gc's live set,
:mod:`objckpt.ops.maintain.live_set`, is the same question asked for a whole root).

What is safe when the answer is unknown: keep. A sibling manifest that cannot be
read, a listing that fails, or a sibling directory holding index objects but no
manifest (a save of another process may be in flight and about to reference them)
keeps every superseded object; they are then ordinary garbage for ``gc``, which
decides over the live set with its grace period.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set

from objckpt.errors import ManifestError, StoreError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, index_rank
from objckpt.format.manifest import read_manifest
from objckpt.format.refs import is_reference, is_step_directory, split_reference
from objckpt.format.steps import parse_step
from objckpt.writers import ObjectStore

__all__ = ["delete_superseded_after", "previous_objects", "referenced_by_siblings"]

logger = logging.getLogger(__name__)


def referenced_by_siblings(store: ObjectStore, keys: Set[str]) -> set[str]:
    """Those of ``keys`` (objects of the step directory ``store`` is at) that another
    step of the same root references, or may be about to; all of them when that
    cannot be told. Empty when ``store`` is not a step directory of a root (then no
    other checkpoint may reference its objects)."""
    if not keys or not is_step_directory(store.location.url):
        return set()
    url = store.location.url.rstrip("/")
    me = url.rsplit("/", 1)[-1]
    path = store.location.path.rstrip("/")
    if "/" not in path:
        return set()
    root = dataclasses.replace(
        store.location, url=url.rsplit("/", 1)[0], path=path.rsplit("/", 1)[0]
    )
    try:
        objects = store.at(root).inventory()
    except StoreError as exc:
        logger.warning(
            "keeping the objects %s replaced: listing %s failed (%s)", url, root.url, exc
        )
        return set(keys)
    manifests: list[str] = []
    indexed: set[str] = set()
    for o in objects:
        head, sep, name = o.key.partition("/")
        if not sep or head == me or parse_step(head) is None:
            continue
        if name == MANIFEST_KEY:
            manifests.append(head)
        elif index_rank(o.key) is not None:
            indexed.add(head)
    in_flight = sorted(indexed - set(manifests))
    if in_flight:
        logger.warning(
            "keeping the objects %s replaced: %s of %s hold index objects and no "
            "manifest (a save may be in flight and reference them); `objckpt gc` "
            "removes them once nothing does",
            url,
            ", ".join(in_flight),
            root.url,
        )
        return set(keys)
    kept: set[str] = set()
    for step_dir in manifests:
        sibling = store.at(root.child(step_dir))
        try:
            entries = read_manifest(sibling).objects
        except (ManifestError, FileNotFoundError, StoreError) as exc:
            logger.warning(
                "keeping the objects %s replaced: the manifest of %s is unreadable (%s)",
                url,
                sibling.location.url,
                exc,
            )
            return set(keys)
        finally:
            sibling.close()
        for entry in entries:
            if is_reference(entry.key):
                target, inner = split_reference(entry.key, f"manifest of {sibling.location.url}")
                if target == me and inner in keys:
                    kept.add(inner)
    return kept


def delete_superseded_after(store: ObjectStore, written: bool, keys: set[str]) -> None:
    """After ``.metadata`` was replaced (``written``): delete ``keys``, what only the
    replaced manifest named, but for those another step of the same root references
    (:func:`objckpt.format.superseded.referenced_by_siblings`). Until it is replaced,
    stock readers load the replaced checkpoint, whose objects must stay: then they
    are kept, and that is logged."""
    # Another step's objects (references) are never this step's to delete; nor are
    # its own objects that later steps of its root reference (#28).
    # .metadata is replaced, never deleted, whether a manifest names it or not (#46).
    keys = {k for k in keys - {MANIFEST_KEY, METADATA_KEY} if not is_reference(k)}
    if written:
        _delete_superseded(store, keys - referenced_by_siblings(store, keys))
    elif keys:
        logger.warning(
            "the objects only the checkpoint %s replaced named are kept (its %s still "
            "points at them); `objckpt gc` removes them",
            store.location.url,
            METADATA_KEY,
        )


def previous_objects(store: ObjectStore) -> set[str]:
    """What the manifest an overwrite replaces names (empty when there is none), and
    ``.metadata`` where one is there: a manifest need not name it (#46), and a
    replaced ``.metadata`` points at the replaced objects until it is replaced too
    (:func:`delete_superseded_after`)."""
    try:
        named = {o.key for o in read_manifest(store).objects}
    except (FileNotFoundError, ManifestError):
        return set()
    if METADATA_KEY not in named and store.exists(METADATA_KEY):
        named.add(METADATA_KEY)
    return named


def _delete_superseded(store: ObjectStore, keys: set[str]) -> None:
    """After an overwrite commits (never before): delete the payload and index
    objects only the replaced manifest named, so re-saving a URL leaves no garbage.
    A failure only leaves garbage behind (``objckpt gc`` removes it) and is logged."""
    if not keys:
        return
    try:
        store.delete_many(sorted(keys))
    except Exception as exc:
        logger.warning(
            "could not delete %d objects of the checkpoint %s replaced (%s); "
            "`objckpt gc` removes them",
            len(keys),
            store.location.url,
            exc,
        )
        return
    logger.info("deleted %d objects of the checkpoint %s replaced", len(keys), store.location.url)
