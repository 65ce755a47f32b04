"""Replication: each node's files of a local step, held by other nodes too.

After a local save commits, every rank sends the files it wrote (its payload
objects and its index object; the coordinator also the manifest and
``.metadata``) to its peer rank on each replica node
(:meth:`objckpt.ops.peers.NodeMap.rounds_for`), and receives its peers' files
into its tier's replica directory. One thread per rank does it, one step at a
time in save order, on the peers' own gloo group: never on the training thread,
never on the training group, never through the object store.

Every rank ends a step's replication with one agreement on that group
(:func:`objckpt.dcp.collective.fail_together`): the step is replicated when every
transfer of every rank was received and checked, and every rank reports the same
answer, naming the first rank (and its node) that failed. A failure never fails a
save: the step stays committed on the local tier, its handle's
``wait_replicated()`` is False, and ``tier_status()`` lists it as not replicated.
A peer that died or hangs holds a transfer until the group's timeout
(``AsyncOptions.barrier_timeout``): replication is bounded, like every wait of a
save.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable

from objckpt.dcp.collective import fail_together
from objckpt.errors import PeerRankError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, index_key, writer_rank
from objckpt.format.steps import step_name
from objckpt.ops.peers import FileSpec, NodeMap, PeerGroup, files_in, replica_dir
from objckpt.ops.tiers import LocalTier
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers.checksum import Crc32c
from objckpt.writers.translate import describe

__all__ = ["Replicator", "start_replication"]

logger = logging.getLogger(__name__)


def _crc_of(path: str) -> tuple[int, str]:
    """Size and CRC32C of a small file (an index object, the manifest)."""
    crc = Crc32c()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc.update(chunk)
            size += len(chunk)
    return size, crc.hexdigest()


class Replicator:
    """One rank's replication of its local steps.

    Args:
        tier: The local tier (``replicas``, ``replica_jump``, this rank's path).
        peers: The group files travel on.
        nodes: Every rank's node.
        rank: This rank in ``peers``' group.
    """

    def __init__(self, tier: LocalTier, peers: PeerGroup, nodes: NodeMap, rank: int) -> None:
        self._tier = tier
        self._peers = peers
        self._nodes = nodes
        self._rank = rank
        self._rounds = nodes.rounds_for(tier.replicas, tier.replica_jump)
        #: How many nodes hold each node's files (its own included).
        self.replicas = 1 + len(self._rounds)
        #: This rank's (receiver, sender) in each round.
        self._pairs = [
            (pairs[rank], {d: r for r, d in pairs.items()}[rank]) for pairs in self._rounds
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="objckpt-replicate"
        )
        self._lock = threading.Lock()
        self._running: dict[int, concurrent.futures.Future[bool]] = {}
        self._replicated: list[int] = []
        self._failed: dict[int, str] = {}
        self.last_error: str | None = None
        self.last_seconds: float | None = None
        self._closed = False
        #: Why the group can no longer carry a replication (a peer did not answer):
        #: later steps are reported not replicated at once, not after a timeout each.
        self._broken: str | None = None

    @property
    def active(self) -> bool:
        """Whether saves are replicated at all (R >= 2 and another node to send to)."""
        return bool(self._rounds)

    def _node(self, rank: int) -> str:
        return f"rank {rank} on node {self._nodes.names[self._nodes.node_of[rank]]}"

    # -- a step ---------------------------------------------------------------------------
    def refill(self, step: int) -> concurrent.futures.Future[bool]:
        """Send this rank's part of ``step`` to its replica nodes again, wherever this
        node holds it (its own directory, or the replicas a load just received):
        after a restore that took a replaced node's files from its peers, the new
        node holds the replicas it held before, and the next loss is covered."""
        outcome: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._start(step, lambda: self._part_files(step), outcome)
        return outcome

    def submit(
        self, step: int, handle: SaveHandle, outcome: concurrent.futures.Future[bool]
    ) -> None:
        """Replicate ``step`` (committed locally, ``handle`` its save) after the steps
        submitted before it; ``outcome`` ends with whether it is replicated."""
        self._start(step, lambda: self._own_files(step, handle), outcome)

    def _start(
        self,
        step: int,
        files: Callable[[], list[FileSpec] | str],
        outcome: concurrent.futures.Future[bool],
    ) -> None:
        with self._lock:
            if self._closed:
                outcome.set_result(False)
                return
            fut = self._pool.submit(self._replicate, step, files)
            self._running[step] = fut

        def done(f: concurrent.futures.Future[bool]) -> None:
            with self._lock:
                if self._running.get(step) is f:
                    del self._running[step]
            ok = not f.cancelled() and f.exception() is None and f.result()
            outcome.set_result(bool(ok))

        fut.add_done_callback(done)

    def _own_files(self, step: int, handle: SaveHandle) -> list[FileSpec] | str:
        """What this rank sends of ``step``: its payload objects (with the CRC32C they
        were written with), its index object, and on the coordinator the manifest and
        ``.metadata``; or why it cannot."""
        where = os.path.join(self._tier.location.path, step_name(step))
        files = [
            FileSpec(e.key, os.path.join(where, e.key), e.size, e.crc32c) for e in handle.written
        ]
        extra = [index_key(self._rank, handle.attempt)] if handle.attempt else []
        if self._rank == 0:
            extra += [MANIFEST_KEY, METADATA_KEY]
        try:
            for key in extra:
                path = os.path.join(where, key)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue  # an index not handed out is read from the root at load
                size, crc = _crc_of(path)
                files.append(FileSpec(key, path, size, crc))
        except OSError as exc:
            return f"cannot read its files of step {step}: {describe(exc)}"
        return files

    def _part_files(self, step: int) -> list[FileSpec] | str:
        """This rank's part of ``step`` as this node holds it after a restore: the
        objects this rank's number wrote (and on the coordinator the manifest and
        ``.metadata``), from the step's directory or its replicas."""
        dirs = [
            os.path.join(self._tier.location.path, step_name(step)),
            replica_dir(self._tier.location.path, step),
        ]
        found: dict[str, str] = {}
        for d in dirs:
            for key in files_in(d):
                ours = writer_rank(key) == self._rank
                if ours or (self._rank == 0 and key in (MANIFEST_KEY, METADATA_KEY)):
                    found.setdefault(key, os.path.join(d, key))
        try:
            return [FileSpec(k, p, *_crc_of(p)) for k, p in sorted(found.items())]
        except OSError as exc:
            return f"cannot read its files of step {step}: {describe(exc)}"

    def _replicate(self, step: int, own: Callable[[], list[FileSpec] | str]) -> bool:
        started = time.monotonic()
        into = replica_dir(self._tier.location.path, step)
        if self._broken is not None:
            why = f"step {step}: replication is off since a peer did not answer: {self._broken}"
            with self._lock:
                self._failed[step] = why
                self.last_error = why
            logger.info("%s", why)
            return False
        try:
            files = own()
        except Exception as exc:  # still walk every exchange: the peers wait for this rank
            files = f"cannot list its files of step {step}: {describe(exc)}"
        error: str | None = files if isinstance(files, str) else None
        lost: str | None = None
        for dst, src in self._pairs:
            try:
                sent, _, received = self._peers.exchange((dst, files), (src, into))
            except Exception as exc:  # a peer dead or stuck: the group's timeout ended it
                lost = f"no answer in the exchange with {self._node(dst)}: {exc}"
                error = error or lost
                break
            if sent is not None:
                error = error or f"{self._node(dst)} did not keep this rank's files: {sent}"
            if received is not None:
                error = (
                    error or f"this rank did not keep the files of {self._node(src)}: {received}"
                )
        failure = None if error is None else RuntimeError(error)
        try:
            fail_together(failure, f"replication of step {step}", self._peers.group)
        except BaseException as exc:
            if lost is not None or (exc is not failure and not isinstance(exc, PeerRankError)):
                self._broken = lost or describe(exc)  # the agreement itself failed
            why = f"step {step} on {self._node(self._rank)}: {exc}" if exc is failure else str(exc)
            with self._lock:
                self._failed[step] = why
                self.last_error = why
            if exc is failure or self._rank == 0:
                logger.warning(
                    "step %d is committed on the local tier but not replicated to other "
                    "nodes (a loss of a node holding it falls back to the newest durable "
                    "step): %s",
                    step,
                    why,
                )
            return False
        seconds = time.monotonic() - started
        with self._lock:
            self._replicated.append(step)
            self.last_error = None
            self.last_seconds = seconds
        logger.info("step %d replicated to %d nodes in %.2f s", step, self.replicas, seconds)
        return True

    # -- status, lifetime -----------------------------------------------------------------
    def running(self) -> set[int]:
        with self._lock:
            return set(self._running)

    def replicated_latest(self, kept: set[int]) -> int | None:
        with self._lock:
            return max((s for s in self._replicated if s in kept), default=None)

    def not_replicated(self, kept: set[int]) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(s for s in self._failed if s in kept))

    def wait(self) -> None:
        with self._lock:
            futures = list(self._running.values())
        concurrent.futures.wait(futures)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


def start_replication(
    tier: LocalTier, peers: PeerGroup | None, nodes: NodeMap | None, rank: int
) -> Replicator | None:
    """A replicator when ``tier`` asks for replicas and there is somewhere to send
    them; else None, with one warning saying why (``replicas`` > 1 only)."""
    if tier.replicas < 2:
        return None
    if peers is None or nodes is None or peers.group is None:
        logger.warning(
            "LocalTier(replicas=%d): no process group, so no other node to replicate to",
            tier.replicas,
        )
        return None
    if nodes.problem is not None:
        logger.warning("LocalTier(replicas=%d): replicas are off: %s", tier.replicas, nodes.problem)
        return None
    replicator = Replicator(tier, peers, nodes, rank)
    if not replicator.active:
        logger.warning(
            "LocalTier(replicas=%d): the job runs on one node (%s), so local steps are not "
            "replicated; a lost node falls back to the newest durable step",
            tier.replicas,
            nodes.names[0],
        )
        return None
    if replicator.replicas < tier.replicas:
        logger.warning(
            "LocalTier(replicas=%d, replica_jump=%d): %d nodes reach only %d distinct "
            "replicas per node",
            tier.replicas,
            tier.replica_jump,
            nodes.nodes,
            replicator.replicas,
        )
    return replicator
