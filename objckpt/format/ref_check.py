"""The commit's check that every object a step references in other steps is there.

A step that reuses unchanged items names objects stored by an earlier step
(``../step-N/<key>``, :mod:`objckpt.format.refs`). Between the save's lookup of
its base and its commit, that step may be deleted (retention, ``rm``, ``gc`` in
another process). The commit therefore lists each referenced step directory once
(never a HEAD per object), immediately before the create-only manifest PUT, as it
lists its own directory (:func:`objckpt.format.settle.require_present`): a
referenced object that is gone, or has another size, fails the save with nothing
committed. What deletes steps spares the objects a committed manifest names; the
remaining window (deleted after this listing, before the PUT lands) is the
deleter's to close: gc and retention delete a step's manifest first, then only
objects no remaining committed manifest names.

Bytes that were already gone when the save looked up its base never fail it here:
that lookup asks for each object it would reference and uploads the items of a
missing or damaged one again instead (:mod:`objckpt.dcp.reuse_base`). What this
check finds went after the lookup, and the message says so.

:func:`stored_where` is how every message about a referenced object names both
steps (the one loaded or verified, and the one storing the bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from objckpt.errors import UploadError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import ObjectEntry
from objckpt.format.refs import referenced_step, split_reference
from objckpt.format.settle import listed_sizes
from objckpt.writers.base import ObjectStore
from objckpt.writers.location import Location

__all__ = ["require_referenced", "sibling", "stored_where"]

_NAMED = 8


def sibling(location: Location, step_dir: str) -> Location:
    """The location of step directory ``step_dir`` beside ``location``'s."""
    url = location.url.rstrip("/").rsplit("/", 1)[0]
    path = location.path.rstrip("/").rsplit("/", 1)[0]
    return dataclasses.replace(location, url=f"{url}/{step_dir}", path=f"{path}/{step_dir}")


def stored_where(location: Location, key: str) -> str:
    """For a message about object ``key`` of the checkpoint at ``location``: which
    two steps are involved when it is a reference (" (stored by <step>, referenced
    by <step>)"), else "". A reused object that is missing or damaged is found
    loading or verifying the step that references it, and the step that stores it
    is the one to look at (or restore)."""
    step_dir = referenced_step(key)
    if step_dir is None:
        return ""
    return f" (stored by {sibling(location, step_dir).url}, referenced by {location.url})"


def require_referenced(
    store: ObjectStore, entries: Iterable[ObjectEntry], *, base: str | None = None
) -> None:
    """Check, with one listing per referenced step directory, that every reference
    in ``entries`` names an object that is there with its recorded size, and that
    the base step (``base``, the step directory the save looked its items up in) is
    still committed: its manifest is in a listing made now.

    Why the base's manifest: a deleter removes a step's manifest first, then the
    objects no remaining committed manifest (and no young uncommitted index object)
    names. This check runs after the save's index objects are written, so either
    the deleter's choice of objects sees them (and spares what they reference) or
    this listing sees the base's manifest gone (and the save fails); the objects
    alone may still be there when the deleter has chosen them already.

    Raises:
        UploadError: A referenced object is gone or has another size, or the base
            step's manifest is gone; the message names the step and the objects.
            Nothing was committed.
        StoreError: A listing failed.
    """
    by_step: dict[str, dict[str, int]] = {}
    for entry in entries:
        step_dir, _ = split_reference(entry.key, f"manifest of {store.location.url}")
        by_step.setdefault(step_dir, {})[entry.key] = entry.size
    if by_step and base is not None:
        by_step.setdefault(base, {})
    for step_dir, want in sorted(by_step.items()):
        where = sibling(store.location, step_dir)
        manifest = f"../{step_dir}/{MANIFEST_KEY}"
        found = listed_sizes(store, [*want, *([manifest] if step_dir == base else [])])
        if step_dir == base and manifest not in found:
            raise UploadError(
                f"refusing to commit {store.location.url}: it reuses bytes through its base "
                f"step {where.url}, whose {MANIFEST_KEY} is gone (the step is being deleted "
                "since this save looked it up); nothing was committed"
            )
        inner_of = {k: split_reference(k)[1] for k in want}
        missing = sorted(inner_of[k] for k in want if k not in found)
        wrong = sorted(inner_of[k] for k in want if k in found and found[k] != want[k])
        sizes = {inner_of[k]: (found.get(k), want[k]) for k in want}
        if not missing and not wrong:
            continue
        parts = []
        if missing:
            named = ", ".join(missing[:_NAMED]) + (", …" if len(missing) > _NAMED else "")
            parts.append(
                f"{len(missing)} of the {len(want)} objects it uses there are gone ({named})"
            )
        if wrong:
            named = ", ".join(
                f"{k} is {sizes[k][0]} bytes, not {sizes[k][1]}" for k in wrong[:_NAMED]
            )
            parts.append(f"{len(wrong)} have another size ({named})")
        # The save's base lookup found each object it references whole (or did
        # not reference it): what is gone now went after that lookup.
        since = ""
        if base is not None:
            since = (
                f", though this save's lookup of its base {base} found them whole: "
                "deleted or replaced since, by another process or by hand"
            )
        raise UploadError(
            f"refusing to commit {store.location.url}: it reuses bytes stored by "
            f"{where.url}, and {'; '.join(parts)}{since}; nothing was committed"
        )
