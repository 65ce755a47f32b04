"""References to bytes another step of the same root stores.

A step saved with reuse (:mod:`objckpt.ops` ``CheckpointManager(reuse_unchanged=True)``)
does not upload an item whose bytes equal an item an earlier committed step of the
same root stores; its index points at the stored bytes instead. Such a key is
written relative to the referencing step's own directory, one level up into a
sibling step directory::

    ../step-0000000001/__0_0.<attempt>.distcp
    ../step-0000000001/3f/__0_0.<attempt>.distcp         (with prefix entropy)
    ../step-0000000001/spread-3f/__0_0.<attempt>.distcp  (with persistent prefixes)

That is the whole grammar: exactly one ``..``, then a step directory name, then a
key that stays inside that directory. It is what stock DCP readers get in
``.metadata`` too (a relative path that a local filesystem resolves). A referenced
object is listed in the referencing manifest's ``objects`` with its size and CRC32C
like any other, so everything that walks a manifest (load, ``verify``, backups,
promotion, gc's live set) sees the step whole.

Keys are kept as the manifest writes them; :func:`root_key` turns either kind into
a key relative to the run's root, which is what the live set of a root and the
objects of a listing are compared in. A spread key (``spread-3f/<name>``, written
with ``UploadOptions(persistent_prefixes=True)``) is a step's own object stored in
front of the step's name (``<root>/spread-3f/step-<N>/<name>``,
:func:`objckpt.writers.location.placed`); it is no reference, and a reference to it
names it by its step as any other (the last example above).
"""

from __future__ import annotations

from collections.abc import Iterable

from objckpt.errors import ManifestError
from objckpt.writers.location import STEP_DIR, Location, is_spread_key, placed

__all__ = [
    "REFERENCE_PREFIX",
    "holds_spread",
    "is_reference",
    "is_step_directory",
    "names_spread",
    "reference_key",
    "referenced_step",
    "require_step_directory",
    "root_key",
    "split_reference",
    "step_token",
    "stock_path",
]

#: Every reference key starts with this.
REFERENCE_PREFIX = "../"


def is_reference(key: str) -> bool:
    """Whether a manifest or index key names another step's object."""
    return key.startswith(REFERENCE_PREFIX)


def split_reference(key: str, where: str = "reference") -> tuple[str, str]:
    """``(step directory name, key inside it)`` of a reference key.

    Raises:
        ManifestError: ``key`` is not exactly ``../step-<digits>/<key>`` with a key
            that stays inside that step directory (``where`` names the object that
            held it).
    """
    parts = key.split("/")
    if (
        len(parts) < 3
        or parts[0] != ".."
        or not STEP_DIR.fullmatch(parts[1])
        or any(p in ("", ".", "..") for p in parts[2:])
        or "\\" in key
        or "\x00" in key
        or "://" in key
    ):
        raise ManifestError(
            f"{where}: reference {key!r} is not ../step-<N>/<object> inside the run's root"
        )
    return parts[1], "/".join(parts[2:])


def names_spread(key: str) -> bool:
    """Whether a manifest key names an object stored in a spread directory: a spread
    key of the step's own, or a reference to another step's."""
    if is_reference(key):
        return is_spread_key(split_reference(key)[1])
    return is_spread_key(key)


def referenced_step(key: str) -> str | None:
    """The step directory a reference key points into, or None for a key of the
    step's own."""
    if not is_reference(key):
        return None
    return split_reference(key)[0]


def reference_key(step_dir: str, key: str) -> str:
    """The key, as a step of the same root writes it, of ``key`` stored by step
    directory ``step_dir``: a reference stays as it is (references are relative to
    the root's step directories, so they mean the same from every step), an own key
    becomes ``../<step_dir>/<key>``."""
    if is_reference(key):
        split_reference(key)
        return key
    result = f"{REFERENCE_PREFIX}{step_dir}/{key}"
    split_reference(result)
    return result


def root_key(step_dir: str, key: str) -> str:
    """``key`` of step directory ``step_dir``'s manifest as a key relative to the
    run's root (``step-0000000002/__0_0.<a>.distcp``, or the referenced step's
    directory for a reference; a spread key in front of its step's name)."""
    if is_reference(key):
        target, inner = split_reference(key)
        return placed(target, inner)
    return placed(step_dir, key)


def stock_path(url: str, key: str) -> str:
    """The ``relative_path`` a stock DCP reader opens for ``key`` of the checkpoint at
    ``url``: the key itself, unless it is stored outside the checkpoint's directory
    (a reference, or a spread key of a step directory), then ``../`` and its place
    under the root, which a local filesystem resolves."""
    if not key.startswith((REFERENCE_PREFIX, "spread-")):
        return key  # (per item of every save: the common case first)
    step_dir = url.rstrip("/").rsplit("/", 1)[-1]
    if not is_reference(key) and not STEP_DIR.fullmatch(step_dir):
        return key
    placed_key = root_key(step_dir, key)
    return key if placed_key == f"{step_dir}/{key}" else REFERENCE_PREFIX + placed_key


def holds_spread(location: Location) -> bool:
    """Whether spread keys may be placed for a checkpoint at ``location``: a step
    directory of a root that is more than a bucket (spread directories beside the
    bucket's top would belong to no root that retention or gc walks)."""
    if not STEP_DIR.fullmatch(location.url.rstrip("/").rsplit("/", 1)[-1]):
        return False
    root = location.parent().path.strip("/")
    return bool(root) and (not location.has_bucket or "/" in root)


def step_token(url: str) -> str | None:
    """``/<step directory>/`` of the checkpoint at ``url`` when it is a step directory
    (how its own spread objects' :func:`stock_path` names it), else None."""
    step_dir = url.rstrip("/").rsplit("/", 1)[-1]
    return f"/{step_dir}/" if STEP_DIR.fullmatch(step_dir) else None


def is_step_directory(url: str) -> bool:
    """Whether the last segment of ``url`` (a checkpoint's own directory) is a step
    directory name ``step-<10 or more ASCII digits>``."""
    return STEP_DIR.fullmatch(url.rstrip("/").rsplit("/", 1)[-1]) is not None


def require_step_directory(url: str, keys: Iterable[str], where: str) -> None:
    """Refuse references in a checkpoint that is not a step directory of a root.

    A reference means "beside me, in the sibling step directory": only a step
    directory has such siblings, and only a root's steps are kept whole by its live
    set. In a checkpoint saved anywhere else (``s3://b/x/ckpt``), ``../step-N/...``
    would read (or copy) objects of whatever lies beside it: a crafted manifest
    must not be able to do that.

    Raises:
        ManifestError: ``url`` is not ``.../step-<N>`` and a key is a reference
            (``where`` names the object that holds it).
    """
    if is_step_directory(url):
        return
    for key in keys:
        if is_reference(key):
            raise ManifestError(
                f"{where}: reference {key!r} in the checkpoint {url}, which is not a step "
                "directory (<root>/step-<N>): references are honoured only between the "
                "steps of one root"
            )
