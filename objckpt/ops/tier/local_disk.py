"""What the local tier holds on this node's disk: listed, judged and removed without trust.

The tier's directory is a place users and other tools can reach, so objckpt treats
what it finds there as untrusted, as it treats bucket contents:

* **Links are never followed.** A step directory that is a symbolic link (a stale
  link to a user's directory, or a committed step moved to another disk and linked
  back) is not listed as a step, not written into (that save goes to the root) and
  not deleted or swept; each start names it in a warning. Writing or deleting
  through a link reaches a directory that is not the tier's own, and objckpt cannot
  tell whose it is.
* **Only objckpt's own files are deleted.** A step directory is removed file by file,
  the manifest first, and only names objckpt writes: attempt-named payloads and
  index objects, ``manifest.json``, ``.metadata`` beside them, and the temporary
  files of a commit. Anything else stays (with a warning), and so does the directory.
* **The start-up sweep is agreed.** Only the coordinator's node holds a step's
  manifest, and after an elastic restart rank 0 may run on another node than before
  (c10d rendezvous keeps no node ranks), so no one rank's directory says which steps
  are committed. Every rank lists its own directory and the lists are all-gathered: a
  step committed on any node, or on the root, is kept on every node; a rank deletes
  only its directories of steps no node and not the root holds committed. A node's
  part of a committed step is kept whatever it holds (a load checks each object and
  reads what is missing or damaged from the root). When any rank cannot list its
  directory, no rank deletes anything at that start: what that directory holds is
  unknown, and deleting on a guess loses the only copy of a local-only step.
* **What kept steps reference stays.** A step saved to the local tier with reuse
  names objects that an earlier local step directory of the same node holds
  (``../step-<N>/<key>``, :mod:`objckpt.format.refs`); retention and the sweep leave
  the files a kept step references (:func:`local_references`), or that step could
  not load from the tier. Each rank holds its own index objects (and the coordinator
  the manifest), so each rank finds them in the files its own node holds: no
  collective is needed. Those files are read as untrusted input, bounded like any
  metadata (:data:`objckpt.format.bounds.DEFAULT_MAX_METADATA_BYTES`); one that is
  too large or malformed is skipped with a warning (what it references is then
  unprotected, as a step whose index is unreadable could not load from the tier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Collection, Iterator
from typing import Literal

from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.errors import LinkRefusedError, ManifestError, ObjckptError
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    index_rank,
    is_entropy_dir,
    is_objckpt_object,
)
from objckpt.format.refs import is_reference, root_key, split_reference
from objckpt.format.steps import parse_step, step_name
from objckpt.ops.tier.peers import replica_dir
from objckpt.ops.tier.tiers import LocalTier
from objckpt.writers.node_store import REPLICAS_DIR, Entry, NodeStore, tier_store

__all__ = [
    "TierListing",
    "delete_local_step",
    "list_tier",
    "local_references",
    "step_dir_refusal",
    "sweep",
]

logger = logging.getLogger(__name__)

# A commit's temporary file: "." + the object's key + "." + 32 hex digits + ".tmp".
_TMP = re.compile(r"\.(?P<key>.+)\.[0-9a-f]{32}\.tmp")  # fullmatch: no $


#: Where the sweep moves a node's copy of a discarded step it does not delete (a name
#: no step has: never listed, loaded or deleted as a step).
SET_ASIDE_DIR = "set-aside"

#: What the run's rollback records say of a node's copy of a step
#: (:func:`objckpt.ops.run.rollback.judge_copy`): None, it may load; ``"stale"``, a
#: record names it (deleted); ``"aside"``, discarded by the clocks (kept, not loaded).
Verdict = Literal["stale", "aside"] | None
#: Asked of each copy above the durable steps: (step, its manifest's bytes, its path).
CopyJudge = Callable[[int, bytes, str], Verdict]


@dataclasses.dataclass(frozen=True)
class TierListing:
    """One rank's local tier directory, as the start-up sweep shares it.

    Attributes:
        path: The directory listed.
        committed: Steps whose directory holds a manifest (committed on this node).
        present: Every step directory (links excluded).
        links: Step names that are symbolic links (never followed), with their targets.
        error: Why the directory could not be listed (None: it was).
        replicas_committed: Steps whose replica directory (other nodes' files,
            :func:`objckpt.ops.tier.peers.replica_dir`) holds the coordinator's manifest:
            committed, even when the coordinator's node is gone.
        replicas_present: Every replica step directory (links excluded).
        discarded: The steps of every copy found discarded: named by a record, or
            moved to ``set-aside/`` (by this rank, or by one sharing its directory).
    """

    path: str
    committed: frozenset[int] = frozenset()
    present: tuple[int, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    error: str | None = None
    replicas_committed: frozenset[int] = frozenset()
    replicas_present: tuple[int, ...] = ()
    discarded: frozenset[int] = frozenset()


def _listed(store: NodeStore, rel: str) -> list[Entry]:
    """The entries of ``rel`` (none when it is gone)."""
    try:
        return store.entries(rel)
    except FileNotFoundError:
        return []


def _list_steps(
    store: NodeStore, under: str, found: list[Entry], links: list[tuple[str, str]]
) -> tuple[set[int], list[int]]:
    """The step directories among ``found``, the entries of ``under`` (committed
    ones, all), without following links (each link found is added to ``links``)."""
    committed: set[int] = set()
    present: list[int] = []
    for e in found:
        step = parse_step(e.name)
        if step is None:
            continue
        rel = f"{under}/{e.name}" if under else e.name
        if e.kind == "link":
            links.append((os.path.join(store.root, rel), e.target))
            continue
        if e.kind != "dir":
            continue
        present.append(step)
        try:
            if stat.S_ISREG(store.stat(f"{rel}/{MANIFEST_KEY}").st_mode):
                committed.add(step)
        except (FileNotFoundError, LinkRefusedError):
            pass
    return committed, present


def list_tier(root: str) -> TierListing:
    """This node's step directories under ``root`` and its replica directories,
    without following links; a listing that fails is reported in the answer, never
    raised (the answer is shared in a collective every rank must reach)."""
    links: list[tuple[str, str]] = []
    store = NodeStore(root)
    try:
        top = _listed(store, "")
        committed, present = _list_steps(store, "", top, links)
        replicas = next((e for e in top if e.name == REPLICAS_DIR), None)
        r_committed: set[int] = set()
        r_present: list[int] = []
        if replicas is not None and replicas.kind == "link":
            links.append((os.path.join(root, REPLICAS_DIR), replicas.target))
        elif replicas is not None:
            found = _listed(store, REPLICAS_DIR)
            r_committed, r_present = _list_steps(store, REPLICAS_DIR, found, links)
    except Exception as exc:
        return TierListing(root, error=f"{type(exc).__name__}: {exc}")
    return TierListing(
        root,
        frozenset(committed),
        tuple(present),
        tuple(links),
        replicas_committed=frozenset(r_committed),
        replicas_present=tuple(r_present),
    )


def step_dir_refusal(path: str) -> str | None:
    """Why a save must not write into the step directory ``path`` (None: it may).

    A link, or anything that is not a directory, under a step's name is refused: the
    save would write where the tier has no say (see the module docstring).
    """
    store, rel = tier_store(path)
    try:
        mode = store.stat(rel).st_mode
    except FileNotFoundError:
        return None
    except LinkRefusedError as exc:
        return str(exc)
    except (OSError, ObjckptError) as exc:
        return f"{path} cannot be checked: {exc}"
    if not stat.S_ISDIR(mode):
        return f"{path} exists and is not a directory"
    return None


def _ours(name: str, beside_ours: bool) -> bool:
    """Whether ``name`` is a file objckpt writes into a step directory."""
    tmp = _TMP.fullmatch(name)
    if tmp is not None:
        name = tmp.group("key")
    if name == MANIFEST_KEY or is_objckpt_object(name):
        return True
    return name == METADATA_KEY and beside_ours


def _unlink_ours(
    store: NodeStore,
    directory: str,
    names: list[str],
    beside_ours: bool,
    keep: Collection[str] = (),
) -> list[str]:
    """Unlink the names of ``directory`` (under ``store``) that are objckpt's
    (manifest first) and not in ``keep``; the others' names are returned. A link is
    unlinked itself, never its target."""
    names = sorted(names, key=lambda n: n != MANIFEST_KEY)
    left = []
    for name in names:
        if name in keep:
            continue
        if not _ours(name, beside_ours):
            left.append(name)
            continue
        with contextlib.suppress(FileNotFoundError):  # a rank on the same node got it
            store.remove(f"{directory}/{name}")
    return left


def delete_local_step(path: str, keep: Collection[str] = ()) -> bool:
    """Delete the local step directory ``path``: objckpt's own files, manifest first.

    Never follows a link (a linked step directory is left as it is); files objckpt
    does not write, and directories other than prefix-entropy ones, stay, and so
    does the directory then. ``keep`` names files (relative to ``path``) that kept
    steps reference (:func:`local_references`): they stay, and so does the
    directory, which is no step any more (its manifest is gone). Errors are logged,
    not raised (a local deletion never fails a save).

    Returns:
        Whether the directory is gone.
    """
    refusal = step_dir_refusal(path)
    if refusal is not None:
        logger.warning("not deleting local step %s: %s", path, refusal)
        return False
    store, rel = tier_store(path)
    try:
        found = [(e.name, e.kind == "dir") for e in store.entries(rel)]
        files = [n for n, d in found if not d]
        beside = any(n == MANIFEST_KEY or is_objckpt_object(n) for n in files)
        left = _unlink_ours(store, rel, files, beside, keep)
        for name in (n for n, d in found if d):
            sub = f"{rel}/{name}"
            if not is_entropy_dir(name):
                left.append(name + "/")
                continue
            inside = {k.split("/", 1)[1] for k in keep if k.startswith(name + "/")}
            names = [e.name for e in store.entries(sub)]
            inner = _unlink_ours(store, sub, names, True, inside)
            if inner:
                left.extend(f"{name}/{n}" for n in inner)
            elif not inside:
                with contextlib.suppress(FileNotFoundError):
                    store.remove_dir(sub)
        if keep:
            logger.info("local step %s keeps %d file(s) later steps reference", path, len(keep))
            return False
        if left:
            logger.warning(
                "local step %s holds %d file(s) objckpt did not write (%s); they stay, "
                "and so does the directory",
                path,
                len(left),
                ", ".join(sorted(left)[:5]),
            )
            return False
        with contextlib.suppress(FileNotFoundError):
            store.remove_dir(rel)
    except FileNotFoundError:
        return True
    except (OSError, ObjckptError) as exc:
        logger.warning("cannot delete local step %s: %s", path, exc)
        return False
    return True


def sweep(
    tier: LocalTier,
    durable: Collection[int],
    collectives: Collectives,
    judge: CopyJudge | None = None,
) -> tuple[frozenset[int], frozenset[int]]:
    """At start, every rank together (a collective): delete the step directories that
    can never load, on every node alike.

    Each rank first asks ``judge`` (the run's rollback records; None: there are
    none, or they could not be read, and nothing is judged) of each copy of a step above the durable
    ones it holds: a copy a record names is not counted, and deleted below unless
    another node holds a current copy of the step; one discarded by the clocks
    (a record names only the copies some node held at the discard) is moved to
    ``<tier>/set-aside/`` and not counted (a node that was away during ``discard_after``
    must not bring a discarded step back as the run's newest).

    A step is kept when any rank's directory holds its manifest (in the step's own
    directory or among the replicas other nodes sent), or the root holds it
    committed (``durable``); a rank deletes its own directories, and its replica
    directories, of every other step (what a save or a replication killed before
    its end left). When any rank cannot list its directory, nothing is deleted
    anywhere (each rank warns, naming it).

    Returns:
        The steps committed on some rank's tier (empty when a listing failed), and
        those of the steps some rank found discarded (the same on every rank).
    """
    root = tier.location.path
    mine = list_tier(root)
    for path, target in mine.links:
        logger.warning(
            "local step %s is a symbolic link to %s: the local tier does not follow "
            "links (it neither lists, writes nor deletes through one); move the "
            "directory back under %s to use it",
            path,
            target,
            root,
        )
    if judge is not None and mine.error is None:
        mine = _judged(mine, judge, max(durable, default=None))
    views = collectives.all_gather_object(mine) if is_distributed() else [mine]
    discarded = frozenset().union(*(v.discarded for v in views))
    failed = [(r, v) for r, v in enumerate(views) if v.error is not None]
    if failed:
        for r, v in failed:
            logger.warning(
                "local tier not swept at this start on any rank: rank %d cannot list %s (%s)",
                r,
                v.path,
                v.error,
            )
        return frozenset(), frozenset()
    on_nodes = frozenset().union(
        *(v.committed for v in views), *(v.replicas_committed for v in views)
    )
    known = set(durable) | on_nodes
    referenced = local_references(root, [s for s in mine.present if s in known])
    for step in mine.present:
        if step in known:
            continue
        path = os.path.join(root, step_name(step))
        prefix = step_name(step) + "/"
        keep = {k[len(prefix) :] for k in referenced if k.startswith(prefix)}
        if step in discarded:
            logger.info("deleting %s: a copy of a step a rollback discarded", path)
        elif not keep:
            logger.info("deleting %s: a local save that never committed (a crash left it)", path)
        delete_local_step(path, keep)
    for step in mine.replicas_present:
        if step in known:
            continue
        path = replica_dir(root, step)
        logger.info("deleting %s: replicas of a step no node and not the root holds", path)
        delete_local_step(path)
    return on_nodes, discarded


def _judged(mine: TierListing, judge: CopyJudge, durable: int | None) -> TierListing:
    """``mine`` once ``judge`` has seen each copy above ``durable`` (see :func:`sweep`):
    a stale copy no longer committed (the sweep then deletes it as it deletes any
    step no node holds, sparing what kept steps reference); a copy set aside moved
    to ``<tier>/set-aside/`` (kept, never loaded, and the step's name free for the
    run to save again). A manifest that cannot be read stays as it is (the restore
    refuses it)."""
    root = mine.path
    store = NodeStore(root)
    stale: set[int] = set()
    stale_replicas: set[int] = set()
    aside: set[int] = set()
    aside_replicas: set[int] = set()
    for step, rel, out, moved in [
        *((s, step_name(s), stale, aside) for s in mine.committed),
        *(
            (s, f"{REPLICAS_DIR}/{step_name(s)}", stale_replicas, aside_replicas)
            for s in mine.replicas_committed
        ),
    ]:
        if durable is not None and step <= durable:
            continue
        try:
            data = store.read_bytes(f"{rel}/{MANIFEST_KEY}", max_bytes=DEFAULT_MAX_METADATA_BYTES)
        except FileNotFoundError:  # a rank sharing the directory set it aside since
            moved.add(step)
            continue
        except (OSError, ObjckptError):
            continue
        verdict = judge(step, data, os.path.join(root, rel, MANIFEST_KEY))
        if verdict == "stale":
            out.add(step)
        elif verdict == "aside":
            moved.add(step)
            to = f"{SET_ASIDE_DIR}/{rel.replace('/', '-')}.{hashlib.sha256(data).hexdigest()[:16]}"
            try:
                store.move_dir(rel, to)
                logger.warning(
                    "moved %s to %s: a copy of a discarded step (delete it once checked)",
                    os.path.join(root, rel),
                    os.path.join(root, to),
                )
            except FileNotFoundError:  # another rank sharing the directory moved it
                pass
            except (OSError, ObjckptError) as exc:
                logger.warning(
                    "could not set %s aside (%s): it is not loaded, but the run cannot "
                    "save step %d on this node until it is moved or deleted",
                    os.path.join(root, rel),
                    exc,
                    step,
                )
    return dataclasses.replace(
        mine,
        committed=mine.committed - stale - aside,
        present=tuple(s for s in mine.present if s not in aside),
        replicas_committed=mine.replicas_committed - stale_replicas - aside_replicas,
        replicas_present=tuple(s for s in mine.replicas_present if s not in aside_replicas),
        discarded=frozenset(stale | stale_replicas | aside | aside_replicas),
    )


# -- what kept steps reference ---------------------------------------------------------
def local_references(root: str, kept: Collection[int]) -> frozenset[str]:
    """Root-relative keys (``step-<N>/<key>``) that the manifests and index objects
    of this node's directories of the ``kept`` steps reference in other steps."""
    out: set[str] = set()
    store = NodeStore(root)
    for step in kept:
        step_dir = step_name(step)
        for key in _keys_in(store, step_dir):
            if is_reference(key):
                try:
                    split_reference(key, os.path.join(root, step_dir))
                except ManifestError:
                    continue
                out.add(root_key(step_dir, key))
    return frozenset(out)


def _keys_in(store: NodeStore, step_dir: str) -> Iterator[str]:
    """The object keys named by the manifest and index objects directly in the
    directory ``step_dir`` of ``store`` (never through a link)."""
    try:
        names = [e.name for e in store.entries(step_dir) if e.kind == "file"]
    except OSError:
        return
    for name in names:
        if name != MANIFEST_KEY and index_rank(name) is None:
            continue
        file = os.path.join(store.root, step_dir, name)
        try:
            data = store.read_bytes(f"{step_dir}/{name}", max_bytes=DEFAULT_MAX_METADATA_BYTES)
            doc = json.loads(data)
        except (OSError, ValueError) as exc:
            logger.warning("local tier: cannot read %s for its references (%s)", file, exc)
            continue
        if not isinstance(doc, dict):
            continue
        if name == MANIFEST_KEY:
            objects = doc.get("objects")
            for o in objects if isinstance(objects, list) else ():
                if isinstance(o, dict) and isinstance(o.get("key"), str):
                    yield o["key"]
        else:
            keys = doc.get("keys")
            yield from (k for k in (keys if isinstance(keys, list) else ()) if isinstance(k, str))
