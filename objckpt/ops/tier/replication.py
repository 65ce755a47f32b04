"""Replication: each node's files of a local step, held by other nodes too.

After a local save commits, every rank sends the files it wrote (its payload
objects and its index object; the coordinator also the manifest and
``.metadata``) to its peer rank on each replica node
(:meth:`objckpt.ops.tier.peers.NodeMap.rounds_for`), and receives its peers' files
into its tier's replica directory. One thread per rank does it, on the peers' own
gloo group: never on the training thread, never on the training group, never
through the object store.

"Replicated" means restorable after this node is lost, so every step settles the
same way on every rank:

* **In save order, whatever order the local commits end in.** A step is reserved
  (:meth:`PeerReplicator.reserve`) when its save is placed, which every rank does in
  the same order, and gets a sequence number; the thread takes the steps in that
  order, waiting for each one's local commit to end. Every exchange carries the
  step and its number, and a receiver that gets another step drops the bytes and
  reports it: bytes are never kept under another step's name.
* **Every reserved step walks its exchanges**, even where the rank's save or its
  index object failed (it sends its error in the header instead of files), so the
  other ranks are never left waiting and no later exchange pairs with it.
* **A check-in before any byte moves**, on that group's c10d store: every rank says
  its save ended (or why not), so one rank's failed save costs no exchange and no
  rank waits on it, and the step's deadline starts alike on every rank.
* **One agreement per step** on the same store: the step is replicated when every
  transfer of every rank was received and checked, and every rank reports the same
  answer, naming the first rank that failed (and its node). A failure never fails
  a save: the step stays committed on the local tier, its handle's
  ``wait_replicated()`` is False, and ``tier_status()`` lists it as not replicated.
* **Bounded.** A step's exchanges share one deadline (``LocalTier``'s
  ``replication_timeout``, 600 s by default), not a
  timeout per message; the group's collectives wait twice that, so a pair that is
  slow but within the bound keeps the others waiting in the agreement, not failing
  it. A peer that did not answer within the step's deadline breaks its pair's
  stream: the agreement carries that too, and replication goes off on every rank
  at once (one agreed decision), naming the rank that was waited on.
* **At most ``max_saves_in_flight`` steps wait to replicate** behind the one replicating
  (committed locally, their replication not begun); a step placed beyond that is
  reported not replicated at once on every rank (decided with the placement's
  all-reduce), so retention may retire it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from objckpt._torch import group_store
from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.errors import LinkRefusedError, PeerSilentError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, index_key, writer_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import step_name
from objckpt.ops.tier.peers import FileSpec, NodeMap, PeerGroup, files_in, replica_dir
from objckpt.ops.tier.tiers import LocalTier
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers.checksum import Crc32c
from objckpt.writers.node_store import REPLICAS_DIR, NodeStore
from objckpt.writers.translate import describe

__all__ = ["PeerReplicator", "start_replication"]

logger = logging.getLogger(__name__)

#: What a rank sends of a step: the files, or why it cannot (sent in the header).
Files = list[FileSpec] | str


def _crc_of(store: NodeStore, rel: str) -> tuple[int, str]:
    """Size and CRC32C of a small file (an index object, the manifest)."""
    crc = Crc32c()
    size = 0
    with store.open_read(rel) as f:
        while chunk := f.read(1 << 20):
            crc.update(chunk)
            size += len(chunk)
    return size, crc.hexdigest()


@dataclasses.dataclass(eq=False)
class _Ticket:
    """One reserved step: its place in the order, what this rank sends (set once its
    local commit ends), and the outcome every rank agrees on."""

    step: int
    seq: int
    outcome: concurrent.futures.Future[bool]
    files: concurrent.futures.Future[Callable[[], Files]] = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    #: Whether its local commit ended (it then counts against ``max_saves_in_flight``).
    ready: bool = False


class PeerReplicator:
    """One rank's replication of its local steps.

    Args:
        tier: The local tier (``replicas``, ``replica_jump``, this rank's path).
        peers: The group files travel on.
        nodes: Every rank's node.
        rank: This rank in ``peers``' group.
        max_waiting: Steps that may wait to replicate at once (``max_saves_in_flight``).
        on_settled: Called with each step once its outcome is known (local retention
            may retire it then, not at the next save).
    """

    def __init__(
        self,
        tier: LocalTier,
        peers: PeerGroup,
        nodes: NodeMap,
        rank: int,
        *,
        max_waiting: int = 1,
        save_timeout: float | None = None,
        on_settled: Callable[[int], None] | None = None,
    ) -> None:
        self._tier = tier
        #: This rank's tier, reached without following a link.
        self._store = NodeStore(tier.location.path)
        self._peers = peers
        #: The collectives of the peers' group (gloo: no side group).
        self._collectives = Collectives(peers.group)
        self._nodes = nodes
        self._rank = rank
        self._max_waiting = max(1, max_waiting)
        self._on_settled = on_settled
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
        self._seq = 0
        self._tickets: dict[int, _Ticket] = {}  # by step: reserved, not settled
        self._outcomes: list[concurrent.futures.Future[bool]] = []  # for wait()
        self._replicated: list[int] = []
        self._failed: dict[int, str] = {}
        self.last_error: str | None = None
        self.last_seconds: float | None = None
        self._closed = False
        #: Why the group can no longer carry a replication (agreed on every rank: a
        #: peer did not answer; or this rank lost the store): later steps are reported
        #: not replicated at once, without a word on the wire.
        self._broken: str | None = None
        #: How long a step waits for its save to end on this rank (the save's own
        #: bound; a save always ends, this only guards against one that never does).
        self._save_timeout = max(3 * peers.timeout, 3 * (save_timeout or peers.timeout))
        #: The agreements' keys of this replicator, on the peers' group's store: a
        #: second manager on the same ranks (whose group may share the store's prefix)
        #: never reads this one's answers.
        self._nonce = uuid.uuid4().hex
        if is_distributed() and peers.group is not None:
            self._nonce = self._collectives.broadcast_object(self._nonce, 0)

    @property
    def active(self) -> bool:
        """Whether saves are replicated at all (R >= 2 and another node to send to)."""
        return bool(self._rounds)

    @property
    def step_timeout(self) -> float:
        """Seconds one step's replication may take (every exchange of it)."""
        return self._peers.timeout

    def _node(self, rank: int) -> str:
        return f"rank {rank} on node {self._nodes.names[self._nodes.node_of[rank]]}"

    # -- reserving and settling steps -----------------------------------------------------
    def backlog_full(self) -> bool:
        """Whether ``max_saves_in_flight`` steps already wait to replicate on this rank behind
        the one replicating (their local commit ended, their replication has not
        begun): the next placed step is refused when this holds on any rank
        (:meth:`refuse`)."""
        with self._lock:
            return sum(t.ready for t in self._tickets.values()) > self._max_waiting

    def reserve(
        self,
        step: int,
        outcome: concurrent.futures.Future[bool],
        files: Callable[[], Files] | None = None,
    ) -> None:
        """Every rank, in save order (when the save of ``step`` is placed): take the
        step's place in the order; ``outcome`` ends with whether it is replicated.
        Unless ``files`` is given, :meth:`submit` or :meth:`cancel` must follow, on
        every path."""
        with self._lock:
            self._seq += 1
            ticket = _Ticket(step, self._seq, outcome)
            if files is not None:
                ticket.files.set_result(files)
                ticket.ready = True
            if self._closed:
                outcome.set_result(False)
                return
            if files is None:
                self._tickets[step] = ticket
            self._outcomes = [o for o in self._outcomes if not o.done()] + [outcome]
            fut = self._pool.submit(self._run, ticket)
        fut.add_done_callback(lambda f: self._settled(ticket, f))

    def refuse(self, step: int, why: str) -> None:
        """Every rank alike (the placement's all-reduce decided it): ``step`` is not
        replicated, at once; it takes no place in the order."""
        self._record_failure(step, f"step {step} is not replicated: {why}", warn=self._rank == 0)

    def submit(self, step: int, handle: SaveHandle) -> None:
        """The local save of ``step`` committed: send this rank's files of it."""
        self._ready(step, lambda: self._own_files(step, handle))

    def cancel(self, step: int, why: str) -> None:
        """The save of ``step`` failed on this rank (or never started): the step still
        walks its exchanges, sending ``why`` instead of files."""
        self._ready(step, lambda: why)

    def refill(self, step: int) -> concurrent.futures.Future[bool]:
        """Every rank alike, after a restore that took a replaced node's files from its
        peers: send this rank's part of ``step`` to its replica nodes again, wherever
        this node holds it (its own directory, or the replicas a load just received),
        each file with the CRC32C the step's manifest records: a damaged copy is
        refused by its receiver, never spread."""
        outcome: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self.reserve(step, outcome, lambda: self._part_files(step))
        return outcome

    def _ready(self, step: int, files: Callable[[], Files]) -> None:
        with self._lock:
            ticket = self._tickets.get(step)
            if ticket is None or ticket.files.done():
                return
            ticket.ready = True
            ticket.files.set_result(files)

    def _settled(self, ticket: _Ticket, f: concurrent.futures.Future[bool]) -> None:
        with self._lock:
            if self._tickets.get(ticket.step) is ticket:
                del self._tickets[ticket.step]
        ok = not f.cancelled() and f.exception() is None and f.result()
        if not f.cancelled() and f.exception() is not None:
            logger.error("replication of step %d failed: %s", ticket.step, f.exception())
        # Retention first: whoever waits on the outcome finds the step retired already.
        if self._on_settled is not None:
            try:
                self._on_settled(ticket.step)
            except Exception:  # retention's own failures are its to report
                logger.exception("after the replication of step %d", ticket.step)
        if not ticket.outcome.done():
            ticket.outcome.set_result(bool(ok))

    # -- what a rank sends ------------------------------------------------------------------
    def _own_files(self, step: int, handle: SaveHandle) -> Files:
        """What this rank sends of ``step``: its payload objects (with the CRC32C they
        were written with), its index object, and on the coordinator the manifest and
        ``.metadata``; or why it cannot."""
        store, where = self._store, step_name(step)
        files = [
            FileSpec(e.key, store, f"{where}/{e.key}", e.size, e.crc32c) for e in handle.written
        ]
        extra = [index_key(self._rank, handle.attempt)] if handle.attempt else []
        if self._rank == 0:
            extra += [MANIFEST_KEY, METADATA_KEY]
        try:
            for key in extra:
                rel = f"{where}/{key}"
                try:
                    size, crc = _crc_of(store, rel)
                except (FileNotFoundError, LinkRefusedError, IsADirectoryError):
                    # None handed out (a rank that wrote nothing) or a stock reader's
                    # file; an index this rank failed to keep cancelled the step.
                    continue
                files.append(FileSpec(key, store, rel, size, crc))
        except OSError as exc:
            return f"cannot read its files of step {step}: {describe(exc)}"
        return files

    def _manifest_entries(self, step: int) -> dict[str, tuple[int, str]] | None:
        """Every rank (a broadcast on the peers' group): the size and CRC32C the
        manifest of ``step`` records for each object, as the coordinator's node holds
        the manifest; None when it cannot read it."""
        entries: dict[str, tuple[int, str]] | None = None
        if self._rank == 0:
            for d in (step_name(step), f"{REPLICAS_DIR}/{step_name(step)}"):
                path = os.path.join(self._store.root, d, MANIFEST_KEY)
                try:
                    data = self._store.read_bytes(f"{d}/{MANIFEST_KEY}")
                    manifest = Manifest.from_json_bytes(data, url=path)
                except (FileNotFoundError, LinkRefusedError, IsADirectoryError):
                    continue
                except (OSError, ValueError) as exc:
                    logger.warning("refill of step %d: cannot read %s: %s", step, path, exc)
                    continue
                entries = {o.key: (o.size, o.crc32c) for o in manifest.objects}
                break
        if not is_distributed() or self._peers.group is None:
            return entries
        result: dict[str, tuple[int, str]] | None = self._collectives.broadcast_object(entries, 0)
        return result

    def _part_files(self, step: int) -> Files:
        """This rank's part of ``step`` as this node holds it after a restore: the
        objects this rank's number wrote (and on the coordinator the manifest and
        ``.metadata``), from the step's directory or its replicas, each with the
        manifest's size and CRC32C (a broadcast from rank 0: every rank calls it)."""
        expected = self._manifest_entries(step)
        if expected is None:
            return f"no manifest of step {step} to check its files against"
        store = self._store
        found: dict[str, str] = {}
        for d in (step_name(step), f"{REPLICAS_DIR}/{step_name(step)}"):
            for key in files_in(store, d):
                ours = writer_rank(key) == self._rank
                if ours or (self._rank == 0 and key in (MANIFEST_KEY, METADATA_KEY)):
                    found.setdefault(key, f"{d}/{key}")
        specs: list[FileSpec] = []
        try:
            for key, rel in sorted(found.items()):
                if key in expected:
                    specs.append(FileSpec(key, store, rel, *expected[key]))
                elif key in (MANIFEST_KEY, METADATA_KEY):  # not listed by the manifest
                    specs.append(FileSpec(key, store, rel, *_crc_of(store, rel)))
        except OSError as exc:
            return f"cannot read its files of step {step}: {describe(exc)}"
        return specs

    # -- one step ---------------------------------------------------------------------------
    def _run(self, ticket: _Ticket) -> bool:
        """One step on this rank: wait for its save, check in with every rank (all
        ready, or the lowest failing rank's reason: then nobody sends a byte), the
        exchanges under one deadline that starts at the check-in, then the outcome,
        agreed."""
        step, seq = ticket.step, ticket.seq
        started = time.monotonic()
        if self._broken is not None:
            why = f"step {step}: replication is off since a peer did not answer: {self._broken}"
            self._record_failure(step, why, warn=False)
            return False
        files: Files
        try:
            files = ticket.files.result(timeout=self._save_timeout)()
        except concurrent.futures.TimeoutError:
            files = f"its save of step {step} had not ended after {self._save_timeout:.0f} s"
        except Exception as exc:
            files = f"cannot list its files of step {step}: {describe(exc)}"
        error: str | None = f"{self._node(self._rank)}: {files}" if isinstance(files, str) else None
        # Every rank ready before a byte moves: one rank's failed save costs no
        # exchange (nobody times out on it), and the step's deadline starts alike.
        outcome = self._agree(seq, "ready", step, error, None, self._save_timeout)
        if outcome is None and not isinstance(files, str):
            lost: str | None = None
            silent = False
            wire = self._peers.until(time.monotonic() + self.step_timeout)
            into = replica_dir(self._tier.location.path, step)
            for dst, src in self._pairs:
                try:
                    sent, _, received = wire.exchange((dst, files), (src, into), step=step, seq=seq)
                except PeerSilentError as exc:
                    waited = dst if exc.rank is None else exc.rank
                    lost = f"{self._node(waited)} did not answer within the step's bound: {exc}"
                    silent = True
                    break
                except Exception as exc:  # the transport failed: this pair's stream is lost
                    lost = f"the exchange with {self._node(dst)} failed: {describe(exc)}"
                    break
                if sent is not None:
                    error = error or f"{self._node(dst)} did not keep this rank's files: {sent}"
                if received is not None:
                    error = error or (
                        f"this rank did not keep the files of {self._node(src)}: {received}"
                    )
            error = error or lost
            outcome = self._agree(seq, "done", step, error, lost, 2 * self.step_timeout, silent)
        if outcome is not None:
            self._record_failure(step, outcome, warn=error is not None or self._rank == 0)
            return False
        seconds = time.monotonic() - started
        with self._lock:
            self._replicated.append(step)
            self.last_error = None
            self.last_seconds = seconds
        logger.info("step %d replicated to %d nodes in %.2f s", step, self.replicas, seconds)
        return True

    def _agree(
        self,
        seq: int,
        phase: str,
        step: int,
        error: str | None,
        lost: str | None,
        wait_s: float,
        silent: bool = False,
    ) -> str | None:
        """Every rank: one outcome for ``phase`` of ``step`` (None: go on; else why
        not: the reason of the lowest rank whose own wait for a peer timed out, else
        of the lowest failing rank), and whether replication goes off for the rest of
        the job, decided together: a pair that lost its stream breaks the group on
        every rank at once, not only on the two ranks of the pair.

        On the peers' group's c10d store, not a collective of that group: gloo closes
        every pair of a rank whose wait timed out, and a collective over the group
        would then fail on every rank without saying why. Each rank posts its answer
        and counts itself in (O(1) requests per rank, none of them W-sized; no rank
        reads every rank's answer); the last one in says so and deletes the step
        before's keys, and every rank reads the one reason."""
        if not is_distributed() or self._peers.group is None:
            if lost is not None:
                self._broken = lost
            return None if error is None else f"step {step}: {error}"
        world = self._peers.world
        base = f"objckpt/replication/{self._nonce}/{seq}/{phase}"
        wait = datetime.timedelta(seconds=wait_s)
        try:
            store = group_store(self._peers.group)
            if error is not None:
                store.set(f"{base}/error/{self._rank}", error)
                _lower_to(store, f"{base}/lowest", self._rank)
                if silent:
                    _lower_to(store, f"{base}/silent", self._rank)
            if lost is not None:
                store.add(f"{base}/lost", 1)
            if store.add(f"{base}/in", 1) == world:  # the last one in
                store.set(f"{base}/all", "1")
                if phase == "ready":
                    for old in ("ready", "done"):
                        _forget(store, f"objckpt/replication/{self._nonce}/{seq - 1}/{old}")
            try:
                store.wait([f"{base}/all"], wait)
            except Exception as exc:
                arrived = store.add(f"{base}/in", 0)
                raise TimeoutError(
                    f"only {arrived} of {world} ranks reached the agreement within {wait_s:.0f} s"
                ) from exc
            broken = store.add(f"{base}/lost", 0) > 0
            named = None
            for key in ("silent", "lowest"):
                if store.check([f"{base}/{key}"]):
                    named = int(store.get(f"{base}/{key}"))
                    break
            cause = None
            if named is not None:
                cause = store.get(f"{base}/error/{named}").decode(errors="replace")
        except Exception as exc:  # the store or a peer is gone: nothing agrees any more
            self._broken = describe(exc)
            return f"step {step}: the ranks could not agree (a peer is gone): {describe(exc)}"
        if broken:
            self._broken = str(cause or lost)
        if named is None:
            return None
        return f"step {step}: {cause}"

    def _record_failure(self, step: int, why: str, *, warn: bool) -> None:
        with self._lock:
            self._failed[step] = why
            self.last_error = why
        if warn:
            logger.warning(
                "step %d is committed on the local tier but not replicated to other nodes "
                "(a loss of a node holding it falls back to the newest durable step): %s",
                step,
                why,
            )
        else:
            logger.info("%s", why)

    # -- status, lifetime -----------------------------------------------------------------
    def running(self) -> set[int]:
        """Steps reserved and not settled (local retention spares them)."""
        with self._lock:
            return set(self._tickets)

    def replicated_latest(self, kept: set[int]) -> int | None:
        with self._lock:
            return max((s for s in self._replicated if s in kept), default=None)

    def not_replicated(self, kept: set[int]) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(s for s in self._failed if s in kept))

    def seconds_left(self) -> float:
        """The most the steps not settled yet may still take once their saves ended:
        each its exchanges (the step's bound) and its agreement (twice that)."""
        with self._lock:
            pending = sum(not o.done() for o in self._outcomes)
        return pending * 3 * self.step_timeout

    def wait(self) -> None:
        """Wait until every step reserved so far is settled (each bounded)."""
        with self._lock:
            outcomes = list(self._outcomes)
        concurrent.futures.wait(outcomes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


def _lower_to(store: Any, key: str, rank: int) -> None:
    """Set ``key`` to ``rank`` unless it already holds a lower rank (compare-and-set,
    so concurrent ranks leave the lowest)."""
    expected = ""
    mine = str(rank)
    while True:
        got = store.compare_set(key, expected, mine).decode()
        if got == mine or (got and int(got) < rank):
            return
        expected = got


def _forget(store: Any, base: str) -> None:
    """Delete an earlier agreement's keys (every rank has read them: it is in the
    next step's). The error keys of failing ranks other than the named ones are few
    (ranks fail rarely) and are left; the store goes with the group."""
    with contextlib.suppress(Exception):
        for key in ("silent", "lowest"):
            if store.check([f"{base}/{key}"]):
                store.delete_key(f"{base}/error/{int(store.get(f'{base}/{key}'))}")
        for key in ("in", "all", "lost", "lowest", "silent"):
            store.delete_key(f"{base}/{key}")


def start_replication(
    tier: LocalTier,
    peers: PeerGroup | None,
    nodes: NodeMap | None,
    rank: int,
    *,
    max_waiting: int = 1,
    save_timeout: float | None = None,
    on_settled: Callable[[int], None] | None = None,
) -> PeerReplicator | None:
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
    replicator = PeerReplicator(
        tier,
        peers,
        nodes,
        rank,
        max_waiting=max_waiting,
        save_timeout=save_timeout,
        on_settled=on_settled,
    )
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
