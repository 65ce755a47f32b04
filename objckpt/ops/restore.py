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
too, so a step no longer needs every node's own disk. Every rank lists what its
tier holds (its own step directories and its replicas of other nodes' files,
:func:`~objckpt.ops.peers.list_holdings`), the listings are gathered on rank 0,
and rank 0 picks the newest step whose every object some surviving rank holds,
or the newest durable one, warning which ranks' files no node holds. During the
load, each rank whose plan reads objects its node lacks receives them from a rank
holding them (:class:`PeerFetch`), checked, into its own replica directory, where
they stay: a replacement node holds its part again. Only what no node holds is
read from the object store; a job restarted on another world size reshards from
the same mix.
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp

from objckpt.dcp.collective import broadcast_from_rank0, gather_object, is_distributed
from objckpt.dcp.load_planner import LoadPlanner
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StateDictMismatchError,
    StoreError,
)
from objckpt.format.layout import MANIFEST_KEY, writer_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import parse_step, step_name
from objckpt.ops.catalog import StepCatalog, on_rank0
from objckpt.ops.peers import (
    FileSpec,
    Holdings,
    PeerGroup,
    Peers,
    Transfer,
    list_holdings,
    replica_dir,
    rounds,
)
from objckpt.ops.tiers import LocalTier
from objckpt.ops.torch_errors import size_mismatch, unwrap
from objckpt.options import ReadOptions
from objckpt.writers.retry import RetryPolicy

__all__ = ["PeerFetch", "Restorer"]

logger = logging.getLogger(__name__)

# What moves a load to the next source (anything else is the caller's mistake).
_SOURCE_FAILED = (CheckpointNotFoundError, IntegrityError, ManifestError, StoreError)


class Restorer:
    """Loads steps of the run ``catalog`` describes.

    Args:
        catalog: Where steps live (root, local tier, backups) and which exist.
        retry: How every store request is retried.
        process_group: The group that loads together.
        peers: The job's peers when the local tier keeps replicas on other nodes.
        tier: The local tier (its ``replicas``), when there is one.
    """

    def __init__(
        self,
        catalog: StepCatalog,
        *,
        retry: RetryPolicy,
        process_group: Any | None = None,
        peers: Peers | None = None,
        tier: LocalTier | None = None,
    ) -> None:
        self._catalog = catalog
        self._tier = tier
        self._retry = retry
        self._group = process_group
        self._peers = peers
        #: Rank 0, during one load: every rank's holdings (None: no peers).
        self._fetch: PeerFetch | None = None
        #: The step the last load took from the nodes while some of its files were on
        #: fewer nodes than the tier's replicas (to replicate again; None: none).
        self.refill: int | None = None

    def load(self, state_dict: dict[str, Any], step: int | None, read: ReadOptions | None) -> int:
        """Load ``step`` (the newest on any tier when None, falling back to the newest
        durable one) into ``state_dict`` in place; returns the step loaded."""
        self.refill = None
        if self._peers is not None:
            newest, durable = self._survey(step)
        elif step is not None:
            return self._load_step(step, state_dict, read)
        else:
            newest, durable = on_rank0(self._catalog.newest, self._group)
        try:
            try:
                return self._load_step(newest, state_dict, read)
            finally:
                self._fetch = None
        except _SOURCE_FAILED as exc:
            self.refill = None
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

    # -- with replicas on other nodes -------------------------------------------------------
    def _survey(self, step: int | None) -> tuple[int, int | None]:
        """Every rank: gather what every tier holds on rank 0, which picks the step to
        load (``step``, or the newest whole on the surviving nodes or durable) and
        whether its objects come from the nodes (:meth:`_decide`); rank 0 keeps the
        holdings for the load's transfers. Two collectives.

        Returns:
            The step to load and the newest durable one.
        """
        tier = self._catalog.local
        assert tier is not None and self._peers is not None
        mine = list_holdings(tier.path, None if step is None else [step])
        views = gather_object(mine, self._group) if is_distributed() else [mine]
        chosen: list[bytes] = []  # rank 0: the chosen step's manifest (not broadcast)
        newest, durable, from_nodes, refill = broadcast_from_rank0(
            lambda: self._decide(step, views or [], chosen), self._group
        )
        manifest = chosen[0] if chosen else None
        self._fetch = None
        self.refill = newest if refill else None
        if from_nodes:
            parsed = None
            if views is not None and manifest is not None:  # rank 0
                parsed = Manifest.from_json_bytes(manifest, url=self._catalog.step_url(newest))
                self._keep_manifest(newest, manifest)
            self._fetch = PeerFetch(self._peers, newest, tier.path, views, parsed)
        return newest, durable

    def _decide(
        self, step: int | None, views: list[Holdings], chosen: list[bytes]
    ) -> tuple[int, int | None, bool, bool]:
        """Rank 0: (step to load, newest durable, whether from the nodes, whether its
        nodes' files must be replicated again after the load: some object is on fewer
        nodes than the tier's replicas, and the job runs on as many ranks as saved
        it); the chosen step's manifest is appended to ``chosen``."""
        for r, v in enumerate(views):
            if v.error is not None:
                logger.warning("rank %d cannot list its local tier %s: %s", r, v.path, v.error)
        try:
            _, durable = self._catalog.newest()
        except CheckpointNotFoundError:
            durable = None
        manifests: dict[int, bytes] = {}
        for v in views:
            for s, data in v.manifests.items():
                manifests.setdefault(s, data)
        candidates = sorted(manifests, reverse=True) if step is None else [step]
        for s in candidates:
            if step is None and durable is not None and s <= durable:
                break
            if s not in manifests:
                continue
            try:
                manifest = Manifest.from_json_bytes(manifests[s], url=self._catalog.step_url(s))
            except ManifestError as exc:
                logger.warning("step %d: the local tiers' manifest is unusable: %s", s, exc)
                continue
            lost = [
                o
                for o in manifest.objects
                if not any(v.objects.get(s, {}).get(o.key) == o.size for v in views)
            ]
            if not lost:
                chosen.append(manifests[s])
                return s, durable, True, self._thin(s, manifest, views)
            ranks = sorted({r for r in (writer_rank(o.key) for o in lost) if r is not None})
            logger.warning(
                "step %d is committed on the local tier but no surviving node holds all of "
                "it: %d object(s) of rank(s) %s are on no node (their node and every node "
                "holding their replicas are gone)%s",
                s,
                len(lost),
                ", ".join(map(str, ranks)) or "?",
                "" if durable is None else f"; loading step {durable}, the newest durable one",
            )
        if step is not None:
            return step, durable, False, False
        if durable is None:
            raise CheckpointNotFoundError(
                f"no committed step under {self._catalog.root.url} nor whole on the local "
                f"tiers of the nodes that are left"
            )
        return durable, durable, False, False

    def _thin(self, step: int, manifest: Manifest, views: list[Holdings]) -> bool:
        """Whether some object of ``step`` is held by fewer nodes than the tier's
        replicas (a node was replaced), when the same ranks can send it again."""
        assert self._peers is not None
        nodes = self._peers.nodes
        if manifest.world_size != len(views) or nodes.problem is not None:
            return False
        tier = self._tier
        want = nodes.effective_replicas(tier.replicas, tier.replica_jump) if tier else 1
        for o in manifest.objects:
            held = {
                nodes.node_of[r]
                for r, v in enumerate(views)
                if v.objects.get(step, {}).get(o.key) == o.size
            }
            if len(held) < want:
                return True
        return False

    def _keep_manifest(self, step: int, data: bytes) -> None:
        """Rank 0: the step's manifest in its own tier, when its node holds none (it
        came from another node's): the load reads it there, not from the store."""
        tier = self._catalog.local
        assert tier is not None
        own = os.path.join(tier.path, step_name(step), MANIFEST_KEY)
        into = replica_dir(tier.path, step)
        path = os.path.join(into, MANIFEST_KEY)
        if os.path.isfile(own) or os.path.isfile(path):
            return
        try:
            os.makedirs(into, exist_ok=True)
            tmp = os.path.join(into, f".{MANIFEST_KEY}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # the load reads it from the store, and fails over there
            logger.warning("cannot keep the manifest of step %d at %s: %s", step, path, exc)

    def _load_step(self, step: int, state_dict: dict[str, Any], read: ReadOptions | None) -> int:
        """Load ``step`` from the root, then each backup: every object from this
        node's local copy first when there is one (its own files, then its replicas
        of other nodes' files)."""
        local = self._catalog.local_step_url(step)
        roots = [self._catalog.root] + [b.location for b in self._catalog.backups]
        failures: list[BaseException] = []
        for i, root in enumerate(roots):
            url = root.child(step_name(step)).url
            fetch = self._fetch if i == 0 and self._fetch is not None else None
            if fetch is not None and fetch.step != step:
                fetch = None
            try:
                self._load_from(url, root.storage_options, state_dict, read, local, fetch)
            except _SOURCE_FAILED as exc:
                failures.append(exc)
                if i + 1 < len(roots):
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
            read=read,
            retry=self._retry,
            broadcast=distributed,
            process_group=self._group,
            allow_stock=False,  # a step exists only once its manifest is committed
            local=dirs or None,
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
            mismatch = size_mismatch(exc)
            if mismatch is not None:
                raise StateDictMismatchError(
                    f"the state dict does not fit {url}: {mismatch}"
                ) from exc
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        logger.info(
            "loaded %s; this rank's load cost %s%s",
            url,
            reader.requests.summary(),
            f" and {reader.local_bytes_read} bytes from {local}" if local else "",
        )


class PeerFetch:
    """The objects a load's ranks lack on their nodes, sent by ranks that hold them.

    Rank 0 plans (:meth:`schedule`, from every rank's holdings and what each rank's
    load plan reads); every rank walks the plan in ``read_data`` (:meth:`fetch`):
    rounds in which each rank sends at most one stream and receives at most one
    (:func:`objckpt.ops.peers.rounds`), so every pair of a round moves at once.

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
        self._views = views
        self._entries = {} if manifest is None else {o.key: o for o in manifest.objects}

    def schedule(self, needs: list[set[str]]) -> list[Any]:
        """Rank 0: for each rank, the objects it reads and its node lacks, each from
        the least-loaded rank holding it intact (a writer's objects from one holder
        where one holds them all); the same plan for every rank."""
        assert self._views is not None
        held = [v.objects.get(self.step, {}) for v in self._views]

        def holds(h: int, rank: int, ks: list[str]) -> bool:
            return h != rank and all(held[h].get(k) == self._entries[k].size for k in ks)

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
                whole = [h for h in range(len(held)) if holds(h, rank, group)]
                for ks in [group] if whole else [[k] for k in group]:
                    holders = whole or [h for h in range(len(held)) if holds(h, rank, ks)]
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
        for base in (
            os.path.join(self._tier_path, step_name(self.step)),
            replica_dir(self._tier_path, self.step),
        ):
            path = os.path.join(base, key)
            if os.path.isfile(path) and not os.path.islink(path):
                return path
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
                    files.append(FileSpec(k, path, *specs[k]))
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
        if errors:
            # An IntegrityError: the load moves on (backups, then the newest durable step).
            raise IntegrityError(
                f"step {self.step}: this rank did not receive what its node lacks from the "
                f"other nodes: {'; '.join(errors)}"
            )
