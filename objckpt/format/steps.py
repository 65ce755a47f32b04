"""Steps under a root: naming, and one listing that tells what is there.

A manager keeps step N at ``<root>/step-<N, 10 digits>/`` so that a plain
lexical listing sorts by step. A step exists for users only once committed
(its ``manifest.json`` is present); everything else under a step directory is
either part of a committed step or garbage from a failed or in-flight save.

Two ways to look, for two kinds of caller:

- :func:`inventory`: one recursive listing of every object under the root
  (paginated by the store). ``ls``, gc and the deletion of a step need every
  object's name, size and age, and it costs what the root holds: O(ranks x steps)
  entries, one more request per 1,000 objects.
- :func:`committed_steps`: which steps are committed, and when, from one listing
  of the root's top level (one entry per step directory) and one HEAD of each
  step's manifest. A training job asks this in the manager's constructor and
  in every load, on rank 0 for everyone, so its cost must not grow with the
  world size: a job of 4,096 ranks writes ~8,000 objects per step, and a
  recursive listing of them would be the manager's one O(W) request.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import datetime
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fsspec import AbstractFileSystem

from objckpt.errors import BucketNotFoundError, ConfigurationError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = [
    "ObjectInfo",
    "StepInfo",
    "committed_steps",
    "inventory",
    "parse_step",
    "require_bucket",
    "step_name",
    "steps_of",
]

logger = logging.getLogger(__name__)

STEP_DIGITS = 10
#: Manifest HEADs in flight at once in :func:`committed_steps` (a root that keeps
#: hundreds of steps is answered in a few round trips, not hundreds).
HEAD_CONCURRENCY = 16
# ASCII digits, the whole name: fullmatch (``$`` would let a trailing newline in).
_STEP = re.compile(rf"step-([0-9]{{{STEP_DIGITS},}})")


def step_name(step: int) -> str:
    """``step-0000000100`` for step 100.

    Raises:
        ConfigurationError: ``step`` is not a non-negative int.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigurationError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step number of a directory name, or None if it is not a step directory."""
    m = _STEP.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object under the root.

    Attributes:
        key: Path relative to the root (``step-0000000100/manifest.json``).
        size: Bytes.
        modified: Last-modified time (seconds since the epoch), None when the
            store does not say (such objects are never collected).
    """

    key: str
    size: int
    modified: float | None


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a step directory holds.

    ``objects`` and ``bytes`` count the step directory's objects where it was found
    by :func:`inventory`; :func:`committed_steps` reads only the manifest and
    counts that one object (its size).
    """

    step: int
    url: str
    committed: bool
    objects: int
    bytes: int
    modified: float | None  # newest object's time (the commit time, when committed)


def _mtime(info: Mapping[str, Any]) -> float | None:
    for name in ("LastModified", "mtime", "updated", "last_modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=datetime.timezone.utc)
            return parsed.timestamp()
    return None


def inventory(fs: AbstractFileSystem, root: Location) -> list[ObjectInfo]:
    """Every object under ``root`` (one recursive listing), sorted by key.

    An empty answer from an object store is checked once more: a root in a bucket
    that does not exist must not look like a root without steps (a typo in the
    bucket name would otherwise read as "nothing saved yet").

    Raises:
        BucketNotFoundError: The root's bucket does not exist (object stores only;
            a missing local directory is an empty root).
        StoreError: The listing failed (translated, naming the root).
    """
    fs.invalidate_cache(root.path)
    try:
        found = fs.find(root.path, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as exc:
        raise translate(exc, url=root.url, action="listing", missing_is_bucket=True) from exc
    if not found:
        require_bucket(fs, root)
        return []
    prefix = root.path.rstrip("/") + "/"
    out = []
    for path, info in found.items():
        path = str(path)
        if info.get("type") == "directory":
            continue
        if not path.startswith(prefix):
            path = "/" + path if ("/" + path).startswith(prefix) else path
        key = path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
        out.append(ObjectInfo(key, int(info.get("size") or 0), _mtime(info)))
    return sorted(out, key=lambda o: o.key)


def require_bucket(fs: AbstractFileSystem, root: Location) -> None:
    """Raise when ``root``'s bucket does not exist (one request; object stores only).

    Raises:
        BucketNotFoundError: Named for the bucket and ``root``.
        StoreError: The check itself failed (translated, naming ``root``).
    """
    if root.is_local:
        return
    try:
        exists = fs.exists(root.bucket)
    except Exception as exc:
        raise translate(exc, url=root.url, action="listing", missing_is_bucket=True) from exc
    if not exists:
        raise BucketNotFoundError(f"bucket {root.bucket!r} of {root.url} does not exist")


def steps_of(objects: Iterable[ObjectInfo], root: Location) -> list[StepInfo]:
    """Step directories found in an inventory, ascending by step."""
    groups: dict[int, list[ObjectInfo]] = {}
    for obj in objects:
        head, sep, _ = obj.key.partition("/")
        step = parse_step(head) if sep else None
        if step is not None:
            groups.setdefault(step, []).append(obj)
    out = []
    for step, objs in sorted(groups.items()):
        names = {o.key.split("/", 1)[1] for o in objs}
        times = [o.modified for o in objs if o.modified is not None]
        out.append(
            StepInfo(
                step=step,
                url=root.child(step_name(step)).url,
                committed=MANIFEST_KEY in names,
                objects=len(objs),
                bytes=sum(o.size for o in objs),
                modified=max(times) if times else None,
            )
        )
    return out


def committed_steps(fs: AbstractFileSystem, root: Location) -> list[StepInfo]:
    """The committed steps under ``root``, ascending, without listing their objects.

    One listing of the root's top level finds the step directories; one HEAD per
    step directory (:data:`HEAD_CONCURRENCY` at a time) finds its manifest. A step
    is committed iff its manifest exists, so nothing else is looked at; the
    manifest's time is the commit time. Requests: one LIST page per 1,000 step
    directories plus one HEAD per step, whatever the number of ranks that wrote them.

    Raises:
        BucketNotFoundError: The root's bucket does not exist (object stores only).
        StoreError: The listing or a HEAD failed (translated, naming the URL).
    """
    fs.invalidate_cache(root.path)
    try:
        listed = fs.ls(root.path, detail=True)
    except FileNotFoundError:
        listed = []
    except Exception as exc:
        raise translate(exc, url=root.url, action="listing", missing_is_bucket=True) from exc
    if not listed:
        require_bucket(fs, root)
        return []
    # Only directories named as objckpt names them: a step number written with more
    # digits (made by hand) is another directory, which the manager never uses.
    steps = sorted(
        {
            step
            for info in listed
            if info.get("type") == "directory"
            and (step := parse_step(name := str(info.get("name", "")))) is not None
            and name.rstrip("/").rsplit("/", 1)[-1] == step_name(step)
        }
    )
    if not steps:
        return []
    workers = min(HEAD_CONCURRENCY, len(steps))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="objckpt-steps") as pool:
        # Each HEAD in a copy of this context: counted and bounded like the caller.
        futures = [
            pool.submit(contextvars.copy_context().run, _manifest_of, fs, root, step)
            for step in steps
        ]
        found = [f.result() for f in futures]
    return [info for info in found if info is not None]


def _manifest_of(fs: AbstractFileSystem, root: Location, step: int) -> StepInfo | None:
    """Step ``step``'s StepInfo if its manifest exists (one HEAD), else None."""
    where = root.child(step_name(step))
    path = where.path.rstrip("/") + "/" + MANIFEST_KEY
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise translate(exc, url=where.url_of(MANIFEST_KEY), action="checking") from exc
    if info.get("type") == "directory":
        return None
    size = int(info.get("size") or 0)
    return StepInfo(step, where.url, True, 1, size, _mtime(info))
