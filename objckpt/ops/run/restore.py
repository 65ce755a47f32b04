"""Restore: load one step, each object from the first source that holds it intact.

A step can be read from three places: this node's local tier (fast, but only the
objects this node wrote), the primary root, and the backups. The primary is tried
first, then each backup in order; whichever root is read, every object this node's
local copy holds intact is read from disk instead. A step missing on a root, a
damaged object, or an unreachable store moves the load to the next root.

In a process group every rank must load together: rank 0 lists and picks the step,
reads each manifest once and shares it, and a failure on any rank fails every rank
alike, so all ranks move to the same next source and load the same step from the
same place.

With ``LocalTier(replicas=)`` a node's files of a local step are on other nodes
too, so a step no longer needs every node's own disk. One rank of each node lists
what the node's tier holds (its own step directories and its replicas of other
nodes' files, :func:`~objckpt.ops.tier.peers.list_holdings`), rank 0 reads each node's
listing once, lends it to the node's ranks, and picks the newest step whose
every object some surviving rank holds, or the newest durable one, warning
which ranks' files no node holds. During the load, each rank whose plan reads
objects its node lacks receives them from a rank holding them
(:class:`PeerFetch`), checked, into its own replica directory, where they stay: a
replacement node holds its part again. Only what no node holds is read from the
object store; a job restarted on another world size reshards from the same mix.

The newest step wins only if its holders agree. A node that was away while the
run was rolled back (:func:`~objckpt.CheckpointManager.discard_after`) returns with
its old copy of a discarded step, perhaps beside a new step of the same number.
So rank 0 compares every node's manifest of a step (attempt id and digest) with
the others' and with the root's rollback records (:mod:`objckpt.ops.run.rollback`): a
copy a record discards is never loaded, it is named in a warning and deleted on its
node; two copies that disagree with no record to tell them apart make the step
unusable (the load falls back to the next step down).

One bad copy never blocks a restart. A copy found damaged during the load (its
CRC32C) or a peer that could not send its files makes the load fail on every rank
alike (torch's read phase is agreed); the ranks then list again, each naming what
it found bad (a damaged file of its own node is deleted), and rank 0 decides
again without those copies: another holder sends them, or the step is no longer
whole and the load falls back to the newest durable step. At most
:data:`SURVEYS` decisions per load, each warning names the node that held the
bad copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import stat
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed.checkpoint as dcp

from objckpt._torch import group_store
from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.dcp.load_planner import LoadPlanner
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.torch_errors import first_of, size_mismatch, unwrap
from objckpt.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    ObjckptError,
    StateDictMismatchError,
    StoreError,
)
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES
from objckpt.format.layout import MANIFEST_KEY, writer_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import parse_step, step_name
from objckpt.ops.run.catalog import StepCatalog
from objckpt.ops.run.restore_plan import (
    BadCopy,
    Decision,
    Plan,
    Survey,
    copies_needed,
    decide,
    holders_of,
)
from objckpt.ops.run.rollback import Rollback, judge_copy, manifest_digest, read_rollbacks
from objckpt.ops.tier.local_disk import delete_local_step
from objckpt.ops.tier.peers import (
    FileSpec,
    Holdings,
    PeerGroup,
    Peers,
    Transfer,
    list_holdings,
    replica_dir,
    rounds,
)
from objckpt.ops.tier.tiers import LocalTier
from objckpt.options import ReadOptions
from objckpt.writers.node_store import REPLICAS_DIR, NodeStore
from objckpt.writers.retry import RetryPolicy

__all__ = ["Loaded", "PeerFetch", "Restorer"]

logger = logging.getLogger(__name__)

# What moves a load to the next source (anything else is the caller's mistake).
_SOURCE_FAILED = (CheckpointNotFoundError, IntegrityError, ManifestError, StoreError)

#: Decisions one load makes at most with replicas on other nodes: the first, and
#: one again after each load from the nodes that found a bad copy.
SURVEYS = 3


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What one load took.

    Attributes:
        step: The step loaded.
        refill: It came from the nodes while some of its files were on fewer nodes
            than the tier's replicas: its nodes' files go to their replica nodes again
            (the same on every rank: rank 0 decided).
    """

    step: int
    refill: bool = False


class Restorer:
    """Loads steps of the run ``catalog`` describes.

    Args:
        catalog: Where steps live (root, local tier, backups) and which exist.
        retry: How every store request is retried.
        collectives: The collectives of the group that loads together (the manager's).
        peers: The job's peers when the local tier keeps replicas on other nodes.
        tier: The local tier (its ``replicas``), when there is one.
    """

    def __init__(
        self,
        catalog: StepCatalog,
        *,
        retry: RetryPolicy,
        collectives: Collectives | None = None,
        peers: Peers | None = None,
        tier: LocalTier | None = None,
        on_loaded: Callable[[str, Manifest], None] | None = None,
    ) -> None:
        self._catalog = catalog
        #: Told the URL and manifest of each step loaded (the checkpointer's reuse
        #: memory: a save based on it reads no manifest again).
        self._on_loaded = on_loaded
        self._tier = tier
        self._retry = retry
        self._collectives = collectives or Collectives()
        self._group = self._collectives.group
        self._peers = peers
        #: Without a process group: this process's manifests by (step, digest).
        self._posted: dict[tuple[int, str], bytes] = {}
        #: Without a process group: this process's listing by digest.
        self._listings: dict[str, bytes] = {}
        #: During one load: the peers' transfers of the step loaded (None: none).
        self._fetch: PeerFetch | None = None
        #: During one load: the copies this rank found bad since the last decision.
        self._bad: list[BadCopy] = []
        #: Rank 0, during one load: (step, node, key) of the copies found bad.
        self._excluded: frozenset[tuple[int, int, str]] = frozenset()
        #: During one load: the step decided on from the nodes while some of its files
        #: were on fewer nodes than the tier's replicas (None: none, or its load failed).
        self._refill: int | None = None

    def load(
        self, state_dict: dict[str, Any], step: int | None, read: ReadOptions | None
    ) -> Loaded:
        """Load ``step`` (the newest on any tier when None, falling back to the newest
        durable one) into ``state_dict`` in place; returns what was loaded."""
        self._refill = None
        if self._peers is not None:
            loaded = self._load_from_nodes(state_dict, step, read)
        elif step is not None:
            loaded = self._load_step(step, state_dict, read)
        else:
            newest, durable, refused = self._collectives.from_rank0(self._newest)
            self._catalog.forget_local(refused)  # every rank alike: the order check's bound
            loaded = self._load_or_durable(state_dict, step, read, newest, durable)
        return Loaded(loaded, refill=self._refill == loaded)

    def _load_or_durable(
        self,
        state_dict: dict[str, Any],
        step: int | None,
        read: ReadOptions | None,
        newest: int,
        durable: int | None,
    ) -> int:
        try:
            return self._load_newest(newest, state_dict, read)
        except _SOURCE_FAILED as exc:
            if step is not None:
                raise
            if durable is None or durable == newest:
                raise
            logger.warning(
                "step %d (local tier) cannot be loaded everywhere (%s); loading step %d, "
                "the newest durable one",
                newest,
                exc,
                durable,
            )
            return self._load_step(durable, state_dict, read)

    def _load_newest(self, step: int, state_dict: dict[str, Any], read: ReadOptions | None) -> int:
        """Load ``step``, the newest decided on; its peers' transfers end with it, and a
        failed load refills nothing."""
        try:
            return self._load_step(step, state_dict, read)
        except _SOURCE_FAILED:
            self._refill = None
            raise
        finally:
            self._fetch = None

    # -- with replicas on other nodes -------------------------------------------------------
    def _load_from_nodes(
        self, state_dict: dict[str, Any], step: int | None, read: ReadOptions | None
    ) -> int:
        """Decide (:meth:`_survey`) and load; a load from the nodes that fails is
        decided again without the copies found bad, at most :data:`SURVEYS` times.
        Every rank walks the same: the decision is rank 0's and the load's failure
        is every rank's (torch's read phase)."""
        self._excluded = frozenset()
        self._bad = []
        failed: set[int] = set()
        found: list[BadCopy] = []
        for attempt in range(SURVEYS):
            newest, durable, from_nodes = self._survey(step, failed, found)
            found = []
            if not from_nodes or attempt + 1 == SURVEYS:
                return self._load_or_durable(state_dict, step, read, newest, durable)
            try:
                return self._load_newest(newest, state_dict, read)
            except _SOURCE_FAILED as exc:
                failed.add(newest)
                found = self._take_bad(newest)
                logger.warning(
                    "step %d could not be loaded from the nodes (%s); deciding again "
                    "without the copies found bad",
                    newest,
                    exc,
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _take_bad(self, step: int) -> list[BadCopy]:
        """Every rank, after a failed load of ``step`` from the nodes: the copies it
        found bad; a damaged file of its own tier is deleted (it never loads)."""
        bad = list(self._bad)
        self._bad = []
        tier = self._catalog.local
        for b in bad:
            if b.path is None or tier is None:
                continue
            inside = os.path.abspath(b.path).startswith(os.path.abspath(tier.path) + os.sep)
            if inside:
                # Never raised: every rank goes on into the next survey's gather.
                with contextlib.suppress(OSError, ObjckptError):
                    NodeStore(tier.path).remove(os.path.relpath(b.path, tier.path))
                    logger.warning(
                        "deleted %s: this node's copy of %s of step %d is damaged (%s)",
                        b.path,
                        ", ".join(b.keys),
                        step,
                        b.why,
                    )
        return bad

    def _survey(
        self, step: int | None, failed: set[int] | None = None, found: list[BadCopy] | None = None
    ) -> tuple[int, int | None, bool]:
        """Every rank: gather what every tier holds on rank 0, which picks the step to
        load (``step``, or the newest whole on the surviving nodes or durable) and
        whether its objects come from the nodes (:meth:`_decide_on_rank0`, which reads,
        then :func:`~objckpt.ops.run.restore_plan.decide`); rank 0 keeps the
        holdings for the load's transfers. Two collectives.

        ``failed``: steps whose load from the nodes failed in this load; ``found``:
        the copies this rank found bad since the last decision (gathered with the
        holdings).

        Returns:
            The step to load, the newest durable one, and whether from the nodes.
        """
        tier = self._catalog.local
        assert tier is not None and self._peers is not None
        listing = None
        if self._lists_for_node():
            mine = list_holdings(tier.path, None if step is None else [step])
            digests = self._post_manifests(mine)
            slim = dataclasses.replace(mine, manifests={})  # the bytes went to the store
            listing = self._post_listing(slim, digests)
        gathered = (
            self._collectives.gather_object((listing, found or []))
            if is_distributed()
            else [(listing, found or [])]
        )
        # Rank 0 decides before the broadcast, so that what it alone keeps (the chosen
        # manifest and holdings) stays a local value; its error reaches every rank.
        decided: Decision | BaseException | None = None
        plan: Plan | None = None
        if gathered is not None:
            try:
                plan = self._decide_on_rank0(step, gathered, failed or set())
                decided = plan.decision
            except Exception as exc:
                decided = exc
        decision: Decision = self._collectives.from_rank0(lambda: _decided(decided))
        self._delete_stale(list(decision.stale))
        self._fetch = None
        self._bad = []
        newest = decision.step
        self._refill = newest if decision.refill else None
        if decision.from_nodes:
            parsed, views = None, None
            if plan is not None and plan.manifest is not None:  # rank 0
                views = list(plan.views or ())
                parsed = Manifest.from_json_bytes(plan.manifest, url=self._catalog.step_url(newest))
                self._keep_manifest(newest, plan.manifest)
            self._fetch = PeerFetch(self._peers, newest, tier.path, views, parsed)
        return newest, decision.durable, decision.from_nodes

    def _decide_on_rank0(self, step: int | None, gathered: list[Any], failed: set[int]) -> Plan:
        """Rank 0: read everything the decision needs (the posted listings and
        manifests, the newest durable step, the rollback records), decide
        (:func:`~objckpt.ops.run.restore_plan.decide`, which reads nothing), log its
        warnings and drop what was posted."""
        assert self._peers is not None
        bad = [b for _, bs in gathered for b in bs]
        posted = [d for d, _ in gathered]
        views, held = self._node_listings(posted)
        try:
            try:
                _, durable = self._catalog.newest()
            except CheckpointNotFoundError:
                durable = None
            copies: dict[tuple[int, str], bytes | ManifestError] = {}
            for key in sorted(copies_needed(step, held, durable, failed, bad)):
                try:
                    copies[key] = self._manifest_bytes(*key)
                except ManifestError as exc:
                    copies[key] = exc
            nodes, tier = self._peers.nodes, self._tier
            plan = decide(
                Survey(
                    step=step,
                    views=views,
                    held=held,
                    copies=copies,
                    durable=durable,
                    rollbacks=self.rollback_records() if any(held) else [],
                    failed=frozenset(failed),
                    bad=bad,
                    excluded=self._excluded,
                    nodes=nodes,
                    replicas=nodes.effective_replicas(tier.replicas, tier.replica_jump)
                    if tier
                    else 1,
                    root=self._catalog.root,
                )
            )
        finally:
            self._drop_posted(held, posted)
        for line in plan.warnings:
            logger.warning("%s", line)
        self._excluded = plan.excluded
        return plan

    def _delete_stale(self, stale: list[tuple[int, str]]) -> None:
        """Every rank, one per node: delete this node's step directories (own and
        replicas) whose manifest is one of ``stale`` ((step, SHA-256): copies of a
        discarded step, found by :func:`~objckpt.ops.run.restore_plan.decide`)."""
        assert self._peers is not None
        tier = self._catalog.local
        me = self._peers.group.rank
        if not stale or tier is None or self._peers.nodes.local_of[me] != 0:
            return
        store = NodeStore(tier.path)
        for step, digest in stale:
            for path in (os.path.join(tier.path, step_name(step)), replica_dir(tier.path, step)):
                try:
                    rel = os.path.relpath(os.path.join(path, MANIFEST_KEY), tier.path)
                    data = store.read_bytes(rel)
                except OSError:
                    continue
                if manifest_digest(data) == digest and delete_local_step(path):
                    logger.warning(
                        "deleted %s: a copy of step %d that a rollback discarded", path, step
                    )

    # -- the manifests the nodes hold, each once on the store ------------------------------
    # Every rank's holdings reach rank 0 through one gather, which pads every rank's
    # answer to the largest: with manifest bytes in them (tens of MB at thousands of
    # ranks, held by every rank of two nodes) that is W x the manifest. So a rank sends
    # only each manifest's SHA-256, the first rank holding a copy posts its bytes to
    # the group's c10d store under that digest (content-addressed: a copy posted
    # twice is the same bytes), and rank 0 reads only the ones it decides on.
    def _manifest_key(self, step: int, digest: str) -> str:
        assert self._peers is not None
        return f"objckpt/restore/{self._peers.nodes.nonce}/manifest/{step}/{digest}"

    def _post_manifests(self, mine: Holdings) -> dict[int, str]:
        """This rank's manifests by step, as digests; each posted once by the group."""
        digests = {s: manifest_digest(data) for s, data in mine.manifests.items()}
        if not is_distributed():
            self._posted = {(s, digests[s]): data for s, data in mine.manifests.items()}
            return digests
        try:
            store = group_store(self._group)
            for s, data in mine.manifests.items():
                key = self._manifest_key(s, digests[s])
                if not store.check([key]):  # content-addressed: two posts are the same bytes
                    store.set(key, data)
        except Exception as exc:  # never alone out of the gather: rank 0 finds it missing
            logger.warning("cannot post this node's manifests for the restore: %s", exc)
        return digests

    def _manifest_bytes(self, step: int, digest: str) -> bytes:
        """Rank 0: the bytes of the manifest of ``step`` with ``digest``, as posted."""
        if not is_distributed():
            return self._posted[(step, digest)]
        try:
            store, key = group_store(self._group), self._manifest_key(step, digest)
            if not store.check([key]):  # every post came before the gather
                raise ManifestError(f"step {step}: no rank could post its manifest {digest}")
            data = bytes(store.get(key))
        except ManifestError:
            raise
        except Exception as exc:  # the store's own failure: this copy is unusable, not fatal
            raise ManifestError(f"step {step}: cannot read the posted manifest: {exc}") from exc
        if manifest_digest(data) != digest:  # the store is the job's own, but check what is read
            raise ManifestError(f"step {step}: the posted manifest {digest} has other bytes")
        return data

    def _drop_posted(self, held: list[dict[int, str]], listings: list[str | None]) -> None:
        """Rank 0, once it decided (every rank posted before the gather): delete the
        posted manifests and listings, so a later survey posts again."""
        if not is_distributed():
            return
        store = group_store(self._group)
        keys = {self._manifest_key(s, d) for h in held for s, d in h.items()}
        keys |= {self._listing_key(d) for d in listings if d is not None}
        for key in keys:
            with contextlib.suppress(Exception):
                store.delete_key(key)

    # -- one listing per node ---------------------------------------------------------------
    # The ranks of a node share its tier directory, so one of them (local rank 0) lists
    # it and posts the listing to the group's c10d store under its digest; the gather
    # carries only that digest (no rank's answer is padded to the largest listing), and
    # rank 0 reads each node's listing once and lends it to every rank of the node.
    def _lists_for_node(self) -> bool:
        """Whether this rank lists its tier: the lowest rank of its node whose tier
        is the same directory (:attr:`~objckpt.ops.tier.peers.NodeMap.lister_of`)."""
        assert self._peers is not None
        nodes, me = self._peers.nodes, self._peers.group.rank
        return not nodes.lister_of or nodes.lister_of[me] == me

    def _listing_key(self, digest: str) -> str:
        assert self._peers is not None
        return f"objckpt/restore/{self._peers.nodes.nonce}/listing/{digest}"

    def _post_listing(self, slim: Holdings, digests: dict[int, str]) -> str:
        """This node's listing (holdings without manifest bytes, and the manifests'
        digests) on the group's store; returns its digest."""
        data = pickle.dumps((slim, digests))
        digest = hashlib.sha256(data).hexdigest()
        if not is_distributed():
            self._listings[digest] = data
            return digest
        try:
            store, key = group_store(self._group), self._listing_key(digest)
            if not store.check([key]):  # content-addressed: two posts are the same bytes
                store.set(key, data)
        except Exception as exc:  # never alone out of the gather: rank 0 finds it missing
            logger.warning("cannot post this node's tier listing for the restore: %s", exc)
        return digest

    def _node_listings(
        self, posted: list[str | None]
    ) -> tuple[list[Holdings], list[dict[int, str]]]:
        """Rank 0: every rank's holdings and manifest digests, read once per node from
        the listings posted (``posted``: each rank's digest, None on the ranks that
        did not list); a listing that cannot be read is a node that could not list."""
        assert self._peers is not None
        nodes = self._peers.nodes
        read: dict[str, tuple[Holdings, dict[int, str]]] = {}
        for digest in {d for d in posted if d is not None}:
            try:
                if not is_distributed():
                    data = self._listings[digest]
                else:
                    store, key = group_store(self._group), self._listing_key(digest)
                    if not store.check([key]):  # every post came before the gather
                        raise ValueError("its lister could not post it")
                    data = bytes(store.get(key))
                if hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError("the posted listing has other bytes")
                read[digest] = pickle.loads(data)  # the job's own store, posted just now
            except Exception as exc:
                read[digest] = (Holdings("?", error=f"its listing cannot be read: {exc}"), {})
        self._listings = {}
        views: list[Holdings] = []
        held: list[dict[int, str]] = []
        for r, d in enumerate(posted):
            if d is None and nodes.lister_of:
                d = posted[nodes.lister_of[r]]  # the listing of its node's directory
            v, h = read.get(d or "", (Holdings("?", error="no rank posted its listing"), {}))
            views.append(v)
            held.append(h)
        return views, held

    def rollback_records(self) -> list[Rollback]:
        """Rank 0: the root's rollback records (none, with a warning, when they cannot
        be listed: a load from the nodes then goes on without the root, as it must
        when the root is down, and only the holders' agreement is checked)."""
        try:
            return read_rollbacks(self._catalog.root)
        except Exception as exc:
            logger.warning(
                "cannot read the rollback records under %s (%s): a node's copy of a "
                "discarded step is recognised only where the holders disagree",
                self._catalog.root.url,
                exc,
            )
            return []

    def _newest(self) -> tuple[int, int | None, frozenset[int]]:
        """Rank 0, without peers: the newest step on any tier and the newest durable
        one (:meth:`StepCatalog.newest`), a copy on rank 0's local tier a rollback
        record discards left out (a node that was away during ``discard_after``
        still holds its copy, and it may have come back after the start-up sweep),
        and the steps of the copies so discarded (for every rank's catalog; a copy
        that cannot be read is not loaded now, and not forgotten)."""
        records: list[Rollback] | None = None
        discarded: set[int] = set()

        def loadable(step: int) -> bool:
            nonlocal records
            if records is None:
                records = self.rollback_records()
            if not records:
                return True
            tier = self._catalog.local
            assert tier is not None  # only asked of the local tier's steps
            rel = f"{step_name(step)}/{MANIFEST_KEY}"
            url = os.path.join(tier.path, rel)
            try:
                data = NodeStore(tier.path).read_bytes(rel, max_bytes=DEFAULT_MAX_METADATA_BYTES)
            except (ManifestError, OSError) as exc:
                logger.warning("step %d on the local tier is not loaded: %s", step, exc)
                return False
            if judge_copy(records, step, data, url) is None:
                return True
            discarded.add(step)
            return False

        newest, durable = self._catalog.newest(loadable)
        return newest, durable, frozenset(discarded)

    def _note_damaged(self, reader: ObjectStoreReader, url: str) -> None:
        """The local copies ``reader`` found damaged, as bad copies of this rank's."""
        step = parse_step(url)
        if step is None or self._peers is None or not reader.local_damaged:
            return
        me = self._peers.group.rank
        for key, (path, why) in sorted(reader.local_damaged.items()):
            self._bad.append(BadCopy(step, me, (key,), why, path))

    def _keep_manifest(self, step: int, data: bytes) -> None:
        """Rank 0: the step's manifest in its own tier, when its node holds none (it
        came from another node's): the load reads it there, not from the store."""
        tier = self._catalog.local
        assert tier is not None
        store = NodeStore(tier.path)
        path = os.path.join(replica_dir(tier.path, step), MANIFEST_KEY)
        with contextlib.suppress(OSError):
            if stat.S_ISREG(store.stat(f"{step_name(step)}/{MANIFEST_KEY}").st_mode):
                return
        try:  # the node's one door: no link followed, fsynced, whole or not at all, and
            # create-only: a manifest already there is never replaced
            rel = os.path.relpath(path, tier.path)
            store.write_bytes(rel, data, create_only=True)
        except FileExistsError:
            logger.debug("step %d's manifest is at %s already", step, path)
        except (OSError, ObjckptError) as exc:  # the load reads it from the store instead
            logger.warning("cannot keep the manifest of step %d at %s: %s", step, path, exc)

    def _load_step(self, step: int, state_dict: dict[str, Any], read: ReadOptions | None) -> int:
        """Load ``step`` from the root, then each backup: every object from this
        node's local copy first when there is one (its own files, then its replicas
        of other nodes' files)."""
        places = self._catalog.places(step)
        local = None if places.local is None else places.local.url
        failures: list[BaseException] = []
        for i, where in enumerate([places.root, *places.backups]):
            url = where.url
            fetch = self._fetch if i == 0 and self._fetch is not None else None
            if fetch is not None and fetch.step != step:
                fetch = None
            try:
                self._load_from(url, where.storage_options, state_dict, read, local, fetch)
            except _SOURCE_FAILED as exc:
                failures.append(exc)
                if i < len(places.backups):
                    logger.warning(
                        "cannot load step %d from %s (%s); trying its backup", step, url, exc
                    )
                continue
            if i:
                logger.warning(
                    "loaded step %d from backup %s because the primary failed: %s",
                    step,
                    url,
                    failures[0],
                )
            return step
        if len(failures) > 1:
            failures[0].add_note(
                "backups tried: " + "; ".join(f"{type(e).__name__}: {e}" for e in failures[1:])
            )
        raise failures[0]

    def _load_from(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        state_dict: dict[str, Any],
        read: ReadOptions | None,
        local: str | None = None,
        fetch: PeerFetch | None = None,
    ) -> None:
        distributed = is_distributed()
        dirs: list[str] = []
        if local is not None:
            dirs = [local]
            tier = self._catalog.local
            step = parse_step(url)
            if tier is not None and step is not None and self._peers is not None:
                dirs.append(replica_dir(tier.path, step))
        # With a group, rank 0 reads the manifest and the others receive it: one GET
        # per job, and a missing or damaged manifest fails every rank alike, so all
        # ranks move to the same backup together.
        reader = ObjectStoreReader(
            url,
            storage_options=storage_options,
            # A step exists only once its manifest is committed (no stock checkpoint).
            read=dataclasses.replace(
                read or ReadOptions(), broadcast=distributed, allow_stock=False, local=dirs
            ),
            retry=self._retry,
            process_group=self._group,
            peers=fetch,
        )
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state_dict,
                    storage_reader=reader,
                    planner=LoadPlanner(),  # plans from the chunk runs: flat in W
                    process_group=self._group,
                    no_dist=not distributed,
                )
        except BaseException as exc:
            logger.info("load of %s failed on this rank after %s", url, reader.requests.summary())
            self._note_damaged(reader, url)
            if fetch is not None:
                self._bad.extend(fetch.bad)
            mismatch = size_mismatch(exc)
            if mismatch is not None:
                raise StateDictMismatchError(
                    f"the state dict does not fit {url}: {mismatch}"
                ) from exc
            # A source failure on any rank is every rank's (the others name it as a
            # peer's: "rank 1 could not read the replicated items ..."), so every
            # rank moves on to the same next source.
            inner = first_of(exc, _SOURCE_FAILED) or unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        if self._on_loaded is not None and reader.manifest is not None:
            self._on_loaded(url, reader.manifest)
        logger.info(
            "loaded %s; this rank's load cost %s%s",
            url,
            reader.requests.summary(),
            f" and {reader.local_bytes_read} bytes from {local}" if local else "",
        )


def _decided(decided: Decision | BaseException | None) -> Decision:
    """Rank 0's decision, or its error raised (inside the broadcast, which sends it on)."""
    if isinstance(decided, BaseException):
        raise decided
    assert decided is not None  # rank 0 decided before the broadcast
    return decided


class PeerFetch:
    """The objects a load's ranks lack on their nodes, sent by ranks that hold them.

    Rank 0 plans (:meth:`schedule`, from every rank's holdings and what each rank's
    load plan reads); every rank walks the plan in ``read_data`` (:meth:`fetch`):
    rounds in which each rank sends at most one stream and receives at most one
    (:func:`objckpt.ops.tier.peers.rounds`), so every pair of a round moves at once.

    Args:
        peers: The job's peers.
        step: The step loaded.
        tier_path: This rank's tier directory.
        views: Rank 0: every rank's holdings (None on the others).
        manifest: Rank 0: the step's manifest (sizes and CRC32C of what is sent).
    """

    def __init__(
        self,
        peers: Peers,
        step: int,
        tier_path: str,
        views: list[Holdings] | None,
        manifest: Manifest | None,
    ) -> None:
        self.step = step
        self._peers = peers
        self._wire = peers.group.with_tag(PeerGroup.LOAD_TAG)
        self._tier_path = tier_path
        #: This node's tier, reached without following a link.
        self._store = NodeStore(tier_path)
        self._views = views
        self._entries = {} if manifest is None else {o.key: o for o in manifest.objects}
        #: What this rank did not receive: the sender's copies, found bad.
        self.bad: list[BadCopy] = []

    def schedule(self, needs: list[set[str]]) -> list[Any]:
        """Rank 0: for each rank, the objects it reads and its node lacks, each from
        the least-loaded rank holding it intact (a writer's objects from one holder
        where one holds them all); the same plan for every rank."""
        assert self._views is not None
        held = [v.objects.get(self.step, {}) for v in self._views]
        where = holders_of(self.step, self._views)

        def candidates(rank: int, ks: list[str]) -> list[int]:
            """The ranks other than ``rank`` holding every key of ``ks`` intact (found
            from the index of the first key's holders, never a scan of every rank)."""
            first = where.get((ks[0], self._entries[ks[0]].size), [])
            return [
                h
                for h in first
                if h != rank and all(held[h].get(k) == self._entries[k].size for k in ks[1:])
            ]

        load = [0] * len(held)
        transfers: list[Transfer] = []
        for rank, keys in enumerate(needs):
            missing = sorted(
                k for k in keys if k in self._entries and held[rank].get(k) != self._entries[k].size
            )
            groups: dict[int | None, list[str]] = {}
            for k in missing:
                groups.setdefault(writer_rank(k), []).append(k)
            by_holder: dict[int, list[str]] = {}
            for group in groups.values():
                whole = candidates(rank, group)
                for ks in [group] if whole else [[k] for k in group]:
                    holders = whole or candidates(rank, ks)
                    if not holders:
                        continue  # on no node: read from the store (or the load fails)
                    h = min(holders, key=lambda h: (load[h], h))
                    load[h] += sum(self._entries[k].size for k in ks)
                    by_holder.setdefault(h, []).extend(ks)
            transfers += [Transfer(h, rank, tuple(ks)) for h, ks in sorted(by_holder.items())]
        sent = {k for t in transfers for k in t.keys}
        specs = {k: (self._entries[k].size, self._entries[k].crc32c) for k in sent}
        if transfers:
            logger.info(
                "step %d: %d object(s) (%d bytes) move between nodes before the load",
                self.step,
                len(sent),
                sum(n for n, _ in specs.values()),
            )
        # Each rank gets only its own part of the plan, in round order: its sends (with
        # what the receiver checks) and receives; a rank in no transfer gets nothing.
        mine: list[list[tuple[Transfer | None, Transfer | None]]] = [[] for _ in needs]
        for batch in rounds(transfers):
            into = {t.dst: t for t in batch}
            for t in batch:
                mine[t.src].append((t, into.get(t.src)))
            senders = {t.src for t in batch}
            for t in batch:
                if t.dst not in senders:
                    mine[t.dst].append((None, t))
        return [
            (part, {k: specs[k] for s, _ in part if s is not None for k in s.keys}) for part in mine
        ]

    def _path_of(self, key: str) -> str | None:
        """Where this node holds ``key`` (relative to the tier): its own step
        directory, else the replicas; None when neither holds a file of its name."""
        for base in (step_name(self.step), f"{REPLICAS_DIR}/{step_name(self.step)}"):
            rel = f"{base}/{key}"
            with contextlib.suppress(OSError, ObjckptError):
                if stat.S_ISREG(self._store.stat(rel).st_mode):
                    return rel
        return None

    def fetch(self, planned: Any) -> None:
        """Every rank: walk every round of the plan, sending and receiving its part.

        Raises (after the last round this rank could walk):
            ObjckptError: This rank did not receive an object it reads, naming it
                and the rank that was to send it.
        """
        steps, specs = planned
        me = self._peers.group.rank
        into = replica_dir(self._tier_path, self.step)
        errors: list[str] = []
        for send, recv in steps:
            out: tuple[int, list[FileSpec] | str] | None = None
            if send is not None:
                files: list[FileSpec] = []
                for k in send.keys:
                    path = self._path_of(k)
                    if path is None:
                        out = (send.dst, f"rank {me} no longer holds {k}")
                        break
                    files.append(FileSpec(k, self._store, path, *specs[k]))
                else:
                    out = (send.dst, files)
            try:
                sent, _, received = self._wire.exchange(
                    out, None if recv is None else (recv.src, into)
                )
            except Exception as exc:  # a peer dead or stuck: later rounds would wait too
                errors.append(f"no answer from a peer in step {self.step}'s transfers: {exc}")
                break
            if sent is not None:
                logger.warning(
                    "step %d: rank %d did not keep what this rank sent: %s",
                    self.step,
                    out[0] if out else -1,
                    sent,
                )
            if received is not None and recv is not None:
                errors.append(f"{len(recv.keys)} object(s) from rank {recv.src}: {received}")
                self.bad.append(BadCopy(self.step, recv.src, recv.keys, received))
        if errors:
            # An IntegrityError: the load moves on (backups, then the newest durable step).
            raise IntegrityError(
                f"step {self.step}: this rank did not receive what its node lacks from the "
                f"other nodes: {'; '.join(errors)}"
            )
