"""Peers: which ranks share a node, and moving a step's files between nodes.

A local tier with ``replicas=R`` keeps each node's files of a step on R - 1 other
nodes too, and a restart after a node loss takes what that node held from a peer
instead of the object store. Both need the same two things, which live here:

* **The node map.** A node is what torchrun says it is: ``GROUP_RANK`` (the node's
  index) with ``LOCAL_WORLD_SIZE`` ranks on it; a process started otherwise names
  its node by host name. Every rank's answer is all-gathered once, so every rank
  holds the same map. Node g's files go to nodes ``g + k * replica_jump`` (mod N)
  for k = 1 .. R - 1, as NVIDIA's resiliency extension spreads its cliques: with
  nodes numbered along racks, a jump of the rack size puts every replica in another
  rack. The rank with local index l sends to the rank with local index l on the
  target node, so each round is a permutation: every rank sends one stream and
  receives one, and the N nodes' transfers run at once. That needs the same
  number of ranks on every node; a job without it keeps replicas off (one warning).

* **The wire.** Files travel over torch.distributed point-to-point on a group of
  their own (gloo, on CPU tensors), created at the manager's start: an NCCL
  training group is never used from a background thread, and the object store is
  not involved. A transfer is a header (each file's key, size and CRC32C, or the
  sender's error), the bytes in chunks of :data:`CHUNK` (one buffer per
  direction, reused for every chunk: the memory each side holds), the sender's
  trailer (did every read succeed), and the receiver's ack.
  Both sides walk all of it whatever fails (a read error sends zeros, a full disk
  receives and drops), so one side's failure never leaves the other blocked; only
  a dead or stuck peer does, until the group's timeout. A received file is
  checked against its CRC32C before it is renamed into place: a damaged copy is
  never kept. A received file is written through :mod:`objckpt.writers.node_store`
  (never through a link, fsynced, renamed into place), and every failure, a
  peer's death included, removes the partial files; a sent file is read through
  it too, so a link swapped in under the tier is refused, never sent.
* **A peer's header is untrusted input.** Its length is bounded by
  :data:`HEADER_LIMIT` before anything is allocated, and every size it lists by
  :data:`MAX_FILE_BYTES`; a header outside those bounds cannot be read in step (what
  follows it is unknown), so it breaks the pair as a dead peer does
  (:class:`~objckpt.errors.PeerWireError`). A header within them whose files are
  refused (a name objckpt never writes, too many files) is answered with the
  refusal, and its bytes are still received and dropped, chunk by chunk.

Where a node keeps other nodes' files: ``<tier>/replicas/step-<N>/<key>``, never
in its own step directories, so a replica is never mistaken for the node's own
part (nor listed as a step committed on this node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from objckpt.dcp.collective import Collectives, is_distributed, side_group
from objckpt.errors import (
    LinkRefusedError,
    ManifestError,
    ObjckptError,
    PeerSilentError,
    PeerWireError,
)
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES, load_json
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_entropy_dir, is_objckpt_object
from objckpt.format.steps import parse_step, step_name
from objckpt.writers.checksum import Crc32c
from objckpt.writers.node_store import (
    REPLICAS_DIR,
    Entry,
    NodeStore,
    PendingFile,
    tier_store,
)
from objckpt.writers.translate import describe

__all__ = [
    "CHUNK",
    "HEADER_LIMIT",
    "MAX_FILES",
    "MAX_FILE_BYTES",
    "FileSpec",
    "Holdings",
    "NodeMap",
    "PeerGroup",
    "Peers",
    "Transfer",
    "files_in",
    "list_holdings",
    "node_map",
    "replica_dir",
    "rounds",
]

logger = logging.getLogger(__name__)

#: Bytes per point-to-point message: what a transfer holds in memory on each side.
CHUNK = 16 << 20
#: Most bytes a transfer's header may take (about 15,000 files' entries): checked on
#: both sides before the receiver allocates it.
HEADER_LIMIT = 1 << 20
#: Largest file a header may list: the largest object S3 stores (objckpt's files are
#: a checkpoint's objects). A larger or negative size breaks the pair.
MAX_FILE_BYTES = 5 << 40
#: Most files a header may list and the receiver keep (more are refused, drained).
MAX_FILES = 1 << 16


def replica_dir(tier_path: str, step: int) -> str:
    """Where this node keeps other nodes' files of ``step``."""
    return os.path.join(tier_path, REPLICAS_DIR, step_name(step))


# -- the node map --------------------------------------------------------------------------
def _node_identity() -> tuple[str, int | None]:
    """This process's node as torchrun names it (``GROUP_RANK``), else its host name,
    and ``LOCAL_WORLD_SIZE`` when set."""
    group = os.environ.get("GROUP_RANK")
    size = os.environ.get("LOCAL_WORLD_SIZE")
    node = f"group-rank {int(group)}" if group and group.isdigit() else socket.gethostname()
    return node, int(size) if size and size.isdigit() else None


@dataclasses.dataclass(frozen=True)
class NodeMap:
    """Which node every rank of the group runs on (the same map on every rank).

    Attributes:
        names: Each node's name (``group-rank 3`` or a host name), by node index.
        node_of: The node index of each group rank.
        local_of: Each group rank's index among its node's ranks.
        problem: Why files cannot be paired across nodes (None: they can).
        lister_of: For each group rank, the lowest rank of its node whose tier is the
            same directory (ranks of a node usually share one, but may each have
            their own): the one rank that lists it for a restore. Empty: every rank
            lists its own.
        nonce: Rank 0's random token, the same on every rank: it names this map's
            entries in the group's c10d store, so two managers on one group never
            read or delete each other's.
    """

    names: tuple[str, ...]
    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    problem: str | None = None
    lister_of: tuple[int, ...] = ()
    nonce: str = ""

    @property
    def nodes(self) -> int:
        return len(self.names)

    def ranks_by_node(self) -> list[list[int]]:
        """Each node's ranks, ascending, by node index (one pass over the ranks)."""
        out: list[list[int]] = [[] for _ in self.names]
        for rank, node in enumerate(self.node_of):
            out[node].append(rank)
        return out

    def rounds_for(self, replicas: int, jump: int) -> list[dict[int, int]]:
        """The replication rounds: each a map sender rank -> receiver rank, one per
        k with a target other than the sender's own node (the same for every node,
        since the jump is). O(W) per round: each node's ranks are found once (a
        search per rank was 2.9 s a round at 8,192 ranks, on every rank at start)."""
        if self.problem is not None or self.nodes < 2:
            return []
        by_node = self.ranks_by_node()
        out: list[dict[int, int]] = []
        seen: set[int] = set()
        for k in range(1, replicas):
            shift = (k * jump) % self.nodes
            if shift == 0 or shift in seen:
                continue
            seen.add(shift)
            out.append(
                {
                    rank: by_node[(node + shift) % self.nodes][self.local_of[rank]]
                    for rank, node in enumerate(self.node_of)
                }
            )
        return out

    def effective_replicas(self, replicas: int, jump: int) -> int:
        """How many nodes hold each node's files (its own included)."""
        return 1 + len(self.rounds_for(replicas, jump))


def _directory_identity(path: str | None) -> str | None:
    """Which directory ``path`` is (device and inode, so two spellings or a link to
    one directory are the same), or its absolute path when it cannot be looked at."""
    if path is None:
        return None
    try:
        return NodeStore(path).identity()
    except OSError:
        return os.path.abspath(path)


def node_map(collectives: Collectives, tier_path: str | None = None) -> NodeMap:
    """Every rank's node (and which ranks of a node share one tier directory, when
    ``tier_path`` is given), all-gathered (a collective of ``collectives``' group)."""
    if not is_distributed():
        name, _ = _node_identity()
        return NodeMap((name,), (0,), (0,), lister_of=(0,), nonce=secrets.token_hex(8))
    mine = (_node_identity(), _directory_identity(tier_path), secrets.token_hex(8))
    gathered = collectives.all_gather_object(mine)
    views = [identity for identity, _, _ in gathered]
    first: dict[tuple[str, str | None], int] = {}
    lister_of = tuple(
        first.setdefault((name, directory), r)
        for r, ((name, _), directory, _) in enumerate(gathered)
    )
    names: list[str] = []
    for name, _ in views:
        if name not in names:
            names.append(name)
    # torchrun's node indices order the nodes; host names keep first-seen order.
    if all(n.startswith("group-rank ") for n in names):
        names.sort(key=lambda n: int(n.split()[-1]))
    node_of = tuple(names.index(name) for name, _ in views)
    seen: dict[int, int] = {}
    local_of = []
    for node in node_of:
        local_of.append(seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    sizes = sorted(set(seen.values()))
    problem = None
    if len(sizes) > 1:
        problem = (
            f"the nodes run different numbers of ranks ({', '.join(map(str, sizes))}); "
            "replicas pair each rank with the same local rank on another node"
        )
    declared = {size for _, size in views if size is not None}
    if problem is None and declared and declared != {sizes[0]}:
        problem = (
            f"LOCAL_WORLD_SIZE says {sorted(declared)} ranks per node, but "
            f"{sizes[0]} ranks share each node name"
        )
    return NodeMap(tuple(names), node_of, tuple(local_of), problem, lister_of, gathered[0][2])


# -- what a rank's tier holds --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one rank's tier directory holds of each step, own files and replicas.

    Attributes:
        path: The tier directory.
        objects: Step -> {key: size} of objckpt's objects found, in the step's own
            directory or its replica directory (links never followed).
        manifests: Step -> manifest bytes, for steps whose manifest this tier holds
            (own or replica), each at most the metadata bound.
        error: Why the directory could not be listed (None: it was).
    """

    path: str
    objects: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    manifests: Mapping[int, bytes] = dataclasses.field(default_factory=dict)
    error: str | None = None


def files_in(store: NodeStore, step_dir: str) -> dict[str, int]:
    """objckpt's objects under the step directory ``step_dir`` of ``store`` (and its
    entropy sub-directories), by key, with sizes; nothing through a link."""
    found: dict[str, int] = {}
    # A file deleted while the directory is scanned (a rank of the node deleting a
    # damaged copy) is skipped alone, never the rest of the directory.
    for e in _entries(store, step_dir):
        if e.kind == "file":
            if e.name in (MANIFEST_KEY, METADATA_KEY) or is_objckpt_object(e.name):
                found[e.name] = e.size
        elif e.kind == "dir" and is_entropy_dir(e.name):
            for f in _entries(store, f"{step_dir}/{e.name}"):
                if f.kind == "file" and is_objckpt_object(f.name):
                    found[f"{e.name}/{f.name}"] = f.size
    return found


def _entries(store: NodeStore, rel: str) -> list[Entry]:
    """The entries of directory ``rel`` (none when it is gone, or a link)."""
    try:
        return store.entries(rel)
    except (FileNotFoundError, LinkRefusedError):
        return []


def _read_manifest(store: NodeStore, rel: str) -> bytes | None:
    try:
        return store.read_bytes(rel, max_bytes=DEFAULT_MAX_METADATA_BYTES)
    except ManifestError:
        path = os.path.join(store.root, rel)
        logger.warning("local tier: %s is too large to be a manifest; ignored", path)
        return None
    except (FileNotFoundError, LinkRefusedError):
        return None


def list_holdings(tier_path: str, steps: Iterable[int] | None = None) -> Holdings:
    """What this rank's tier holds (of ``steps`` only, when given); a listing that
    fails is reported in the answer, never raised (it is shared in a collective)."""
    wanted = None if steps is None else set(steps)
    objects: dict[int, dict[str, int]] = {}
    manifests: dict[int, bytes] = {}
    store = NodeStore(tier_path)
    try:
        dirs: list[tuple[int, str]] = []
        for base in ("", REPLICAS_DIR):
            with contextlib.suppress(FileNotFoundError, LinkRefusedError):
                for e in store.entries(base):
                    step = parse_step(e.name)
                    if step is None or e.kind != "dir":
                        continue
                    if wanted is None or step in wanted:
                        dirs.append((step, f"{base}/{e.name}" if base else e.name))
        for step, path in dirs:
            files = files_in(store, path)
            if MANIFEST_KEY in files and step not in manifests:
                data = _read_manifest(store, f"{path}/{MANIFEST_KEY}")
                if data is not None:
                    manifests[step] = data
            files.pop(MANIFEST_KEY, None)
            objects.setdefault(step, {}).update(files)
    except OSError as exc:
        return Holdings(tier_path, error=describe(exc))
    return Holdings(tier_path, objects, manifests)


# -- the transfer plan ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Transfer:
    """Files of one step that group rank ``src`` sends to group rank ``dst``."""

    src: int
    dst: int
    keys: tuple[str, ...]


def rounds(transfers: Sequence[Transfer]) -> list[list[Transfer]]:
    """The transfers in rounds where each rank sends at most one stream and receives
    at most one (first fit, in order): a round runs all its pairs at once, and every
    rank walks the rounds in the same order, so no two ranks ever wait on each other
    in a cycle."""
    out: list[tuple[set[int], set[int], list[Transfer]]] = []
    for t in transfers:
        for senders, receivers, batch in out:
            if t.src not in senders and t.dst not in receivers:
                senders.add(t.src)
                receivers.add(t.dst)
                batch.append(t)
                break
        else:
            out.append(({t.src}, {t.dst}, [t]))
    return [batch for _, _, batch in out]


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One file on the wire: its key, where the sender reads it (``rel`` under
    ``store``'s root: never through a link), its size and CRC32C."""

    key: str
    store: NodeStore
    rel: str
    size: int
    crc32c: str

    @property
    def path(self) -> str:
        """The file, for messages."""
        return os.path.join(self.store.root, self.rel)


def _chunks(sizes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(file index, offset, length) of every message a stream of files of ``sizes``
    takes; both sides compute it from the header. A generator: a header listing
    large files costs no memory for its plan."""
    for i, size in enumerate(sizes):
        for start in range(0, size, CHUNK):
            yield (i, start, min(CHUNK, size - start))


def _read_header(
    data: bytes, src: int
) -> tuple[str | None, list[tuple[Any, int, str]], tuple[Any, Any]]:
    """The sender's error, its files' (key, size, CRC32C) and the (step, sequence
    number) it names, from a header of at most :data:`HEADER_LIMIT` bytes; keys are
    checked later (a refused key's bytes are still drained).

    Raises:
        PeerWireError: The header cannot be read, or lists a size outside
            [0, :data:`MAX_FILE_BYTES`]: how many bytes follow is unknown.
    """
    broken = f"the header from rank {src}"
    try:
        got = load_json(
            data, what="the peer header", url=f"from rank {src}", max_bytes=HEADER_LIMIT
        )
    except ManifestError as exc:
        raise PeerWireError(f"{broken} is unreadable ({exc}); the pair is broken") from exc
    entries = got.get("files", []) if isinstance(got, dict) else None
    if not isinstance(entries, list):
        raise PeerWireError(f"{broken} is no object with a list of files; the pair is broken")
    error = got.get("error")
    listed: list[tuple[Any, int, str]] = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 3 and type(e[1]) is int):
            raise PeerWireError(f"{broken} lists a file as {str(e)[:100]}; the pair is broken")
        key, size, crc = e
        if not 0 <= size <= MAX_FILE_BYTES:
            raise PeerWireError(
                f"{broken} lists a file of {size} bytes (the wire carries 0 to "
                f"{MAX_FILE_BYTES}); what follows cannot be read in step, so the pair is broken"
            )
        listed.append((key, size, str(crc)[:16]))
    if error is None and len(listed) > MAX_FILES:
        error = f"the sender lists {len(listed)} files; a transfer keeps at most {MAX_FILES}"
    tag = (got.get("step"), got.get("seq"))
    return (None if error is None else str(error)[:2000]), listed, tag


def _safe_key(key: object) -> str:
    """A key received from a peer, refused unless it is a name objckpt writes into a
    step directory (no path can leave the directory it is written into)."""
    if not isinstance(key, str):
        raise ObjckptError(f"a peer sent a file name that is no string: {key!r}")
    parts = key.split("/")
    last = parts[-1]
    ok = (last in (MANIFEST_KEY, METADATA_KEY) and len(parts) == 1) or (
        is_objckpt_object(last)
        and (len(parts) == 1 or (len(parts) == 2 and is_entropy_dir(parts[0])))
    )
    if not ok:
        raise ObjckptError(f"a peer sent a file name objckpt never writes: {key!r}")
    return key


def _why(exc: BaseException) -> str:
    """objckpt's own refusals as they are (they name a path and never a secret);
    anything else described."""
    return str(exc) if isinstance(exc, ObjckptError) else describe(exc)


class _Incoming:
    """Files being received into one directory: each into a temporary file (through
    :class:`~objckpt.writers.node_store.NodeStore`: never through a link), checked and
    renamed into place at the end; after the first write error the rest is received
    and dropped (the stream must be walked to its end). :meth:`abort` removes every
    file not yet in place: an exchange that fails half-way leaves nothing."""

    def __init__(self, into: str, header: list[tuple[str, int, str]]) -> None:
        self.into = into
        self.header = header
        self.error: str | None = None
        self._store, self._under = tier_store(into)
        self._pending: dict[int, PendingFile] = {}
        self._crc: dict[int, Crc32c] = {}
        self._got: dict[int, int] = {}

    def _open(self, i: int) -> PendingFile:
        f = self._pending.get(i)
        if f is None:
            f = self._store.create(f"{self._under}/{self.header[i][0]}")
            self._pending[i], self._crc[i], self._got[i] = f, Crc32c(), 0
        return f

    def write(self, i: int, data: memoryview) -> None:
        if self.error is not None:
            return
        try:
            f = self._open(i)
            f.write(data)
            self._crc[i].update(data)
            self._got[i] += len(data)
            if self._got[i] >= self.header[i][1]:
                f.seal()  # its last chunk: one file descriptor open at a time
        except (OSError, ObjckptError) as exc:
            self.error = f"cannot write {os.path.join(self.into, self.header[i][0])}: {_why(exc)}"

    def finish(self, sender_ok: bool) -> list[str]:
        """Check every file and rename it into place; the keys kept."""
        kept: list[str] = []
        try:
            if self.error is None and not sender_ok:
                self.error = "the sender could not read every file"
            for i, (key, size, crc) in enumerate(self.header):
                if self.error is not None:
                    break
                if size == 0:
                    self._open(i)
                got = self._crc[i].hexdigest() if i in self._crc else Crc32c().hexdigest()
                if self._got.get(i, 0) != size:
                    self.error = f"{key}: received {self._got.get(i, 0)} bytes of {size}"
                    break
                if got != crc:
                    self.error = f"{key}: received CRC32C {got}, the sender's manifest says {crc}"
                    break
            if self.error is None:
                for i, (key, _, _) in enumerate(self.header):
                    self._pending[i].commit()
                    kept.append(key)
        except (OSError, ObjckptError) as exc:
            self.error = self.error or f"cannot keep the files in {self.into}: {_why(exc)}"
        finally:
            self.abort()  # what is not in place by now never will be
        return kept

    def abort(self) -> None:
        """Remove every file not renamed into place (never raises)."""
        for f in self._pending.values():
            f.discard()


class PeerGroup:
    """The process group files travel on, and the exchange of one round.

    Args:
        group: A gloo group over the ranks that save together (created by
            :meth:`create`), or None without torch.distributed.
        timeout: Seconds one message may wait for its peer (and, with a deadline, the
            most any message of one step's exchanges waits).
        tag: The point-to-point tag of its messages: replication and a load's
            transfers use their own, so that one can never read the other's.
    """

    REPLICATION_TAG = 7
    LOAD_TAG = 8

    def __init__(
        self,
        group: Any | None,
        timeout: float,
        tag: int = REPLICATION_TAG,
        deadline: float | None = None,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.tag = tag
        #: ``time.monotonic()`` past which no message waits (None: each waits ``timeout``).
        self.deadline = deadline

    def with_tag(self, tag: int) -> PeerGroup:
        """The same group, its messages under ``tag``."""
        return PeerGroup(self.group, self.timeout, tag, self.deadline)

    def until(self, deadline: float) -> PeerGroup:
        """The same group, no message waiting past ``deadline`` (``time.monotonic()``):
        one step's exchanges share one bound, instead of a timeout per message."""
        return PeerGroup(self.group, self.timeout, self.tag, deadline)

    def _wait_seconds(self) -> float:
        if self.deadline is None:
            return self.timeout
        return min(self.timeout, max(0.0, self.deadline - time.monotonic()))

    @classmethod
    def create(cls, process_group: Any | None, timeout: float) -> PeerGroup:
        """A gloo group over ``process_group``'s ranks (a collective on every rank of
        it, like any ``new_group``: :func:`~objckpt.dcp.collective.side_group`); None
        inside without torch.distributed."""
        if not is_distributed():
            return cls(None, timeout)
        # The group's collectives (a step's agreement) wait twice a step's bound: the
        # ranks done first wait there for a pair that is slow but within its bound.
        return cls(side_group(process_group, timeout=2 * timeout), timeout)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def _global(self, rank: int) -> int:
        assert self.group is not None
        return dist.get_global_rank(self.group, rank)

    def _pair(
        self, out: torch.Tensor | None, dst: int | None, inp: torch.Tensor | None, src: int | None
    ) -> None:
        """Send ``out`` to ``dst`` and receive ``inp`` from ``src`` at once.

        Raises:
            PeerSilentError: A peer did not answer in time; it names that peer (the
                one waited on: the sender when nothing arrived, else the receiver).
            PeerWireError: The connection to a peer closed.
        """
        works: list[tuple[Any, int, str]] = []
        if inp is not None and src is not None:
            works.append(
                (dist.irecv(inp, self._global(src), group=self.group, tag=self.tag), src, "sent")
            )
        if out is not None and dst is not None:
            works.append(
                (dist.isend(out, self._global(dst), group=self.group, tag=self.tag), dst, "took")
            )
        for w, peer, what in works:  # the receive first: its sender is the one waited on
            if w is None:
                continue
            seconds = self._wait_seconds()
            try:
                if seconds <= 0 and not w.is_completed():
                    raise PeerSilentError(
                        f"rank {peer} {what} nothing before the step's deadline", rank=peer
                    )
                w.wait(datetime.timedelta(seconds=max(seconds, 0.001)))
            except RuntimeError as exc:
                # gloo closes every pair of a rank whose wait timed out: only a wait of
                # this rank's own that timed out names a silent peer; a closed
                # connection is a bystander's view of someone else's timeout.
                if "timed out" in str(exc).lower():
                    raise PeerSilentError(
                        f"rank {peer} {what} nothing within {seconds:.0f} s: {exc}", rank=peer
                    ) from exc
                raise PeerWireError(
                    f"the connection to rank {peer} closed (a wait elsewhere timed out, or "
                    f"rank {peer} died): {exc}"
                ) from exc

    def _int(self, value: int, dst: int | None, src: int | None) -> int:
        out = torch.tensor([value], dtype=torch.int64)
        inp = torch.zeros(1, dtype=torch.int64)
        self._pair(out, dst, inp, src)
        return int(inp.item())

    def exchange(
        self,
        send: tuple[int, Sequence[FileSpec] | str] | None,
        recv: tuple[int, str] | None,
        *,
        step: int | None = None,
        seq: int | None = None,
    ) -> tuple[str | None, list[str], str | None]:
        """One round on this rank: send files to one peer and receive another's, at once.

        The header names the step and its sequence number (the n-th replication or
        load of this manager): a receiver that gets another step than it expects
        receives the bytes and drops them, and reports it, so bytes are never kept
        under another step's name, whatever order the ranks' saves ended in.

        Args:
            send: (receiver rank, the files, or why this rank cannot send them).
            recv: (sender rank, the directory to receive into).
            step, seq: What this exchange is about, on both sides.

        Returns:
            (why the receiver did not keep what was sent, or None when it did;
            the keys received and kept; why receiving failed, or None).

        Raises:
            RuntimeError: A peer did not answer within the timeout (dead or stuck), or
                sent a header outside the wire's bounds
                (:class:`~objckpt.errors.PeerWireError`); files being received are
                removed first.
        """
        dst = send[0] if send is not None else None
        src = recv[0] if recv is not None else None
        cannot = send[1] if send is not None and isinstance(send[1], str) else None
        files: Sequence[FileSpec] = () if send is None or isinstance(send[1], str) else send[1]
        head = {
            "error": cannot,
            "step": step,
            "seq": seq,
            "files": [[f.key, f.size, f.crc32c] for f in files],
        }
        blob = bytearray(json.dumps(head).encode())
        if len(blob) > HEADER_LIMIT:  # the receiver would refuse it: say why instead
            cannot = f"its header for {len(files)} files takes over {HEADER_LIMIT} bytes"
            files = ()
            blob = bytearray(
                json.dumps({"error": cannot, "step": step, "seq": seq, "files": []}).encode()
            )
        size = self._int(len(blob), dst, src)
        if src is not None and not 0 <= size <= HEADER_LIMIT:
            raise PeerWireError(
                f"rank {src} announced a header of {size} bytes (the wire allows 0 to "
                f"{HEADER_LIMIT}); what follows cannot be read in step, so the pair is broken"
            )
        inp = torch.empty(size if src is not None else 0, dtype=torch.uint8)
        self._pair(torch.frombuffer(blob, dtype=torch.uint8) if blob else None, dst, inp, src)
        incoming: _Incoming | None = None
        recv_error: str | None = None
        theirs: list[tuple[str, int, str]] = []
        if recv is not None and src is not None:
            recv_error, listed, tag = _read_header(inp.numpy().tobytes(), src)
            if tag != (step, seq):
                recv_error = (
                    f"rank {src} sent step {tag[0]} (#{tag[1]}) while this rank expected "
                    f"step {step} (#{seq}); its bytes were dropped"
                )
            try:
                theirs = [(_safe_key(k), n, c) for k, n, c in listed]
            except ObjckptError as exc:  # its bytes are still received (and dropped)
                recv_error = recv_error or str(exc)
                theirs = [("", n, c) for _, n, c in listed]
            incoming = _Incoming(recv[1], theirs)
            incoming.error = recv_error
        try:
            sent_ok = self._stream(files, dst, incoming, src)
            their_ok = bool(self._int(int(sent_ok), dst, src))
        except BaseException:  # a peer dead or stuck: no partial file stays behind
            if incoming is not None:
                incoming.abort()
            raise
        kept: list[str] = []
        if incoming is not None:
            kept = incoming.finish(their_ok and recv_error is None)
            recv_error = recv_error or incoming.error
        ack_blob = (recv_error or "").encode()
        # The receiver's answer goes back the other way: to the sender of what it got.
        ack_size = self._int(len(ack_blob) + 1 if recv is not None else 0, src, dst)
        ack_in = torch.zeros(max(ack_size, 0), dtype=torch.uint8)
        ack_out = torch.frombuffer(bytearray(ack_blob + b"."), dtype=torch.uint8)
        self._pair(
            ack_out if recv is not None else None, src, ack_in if dst is not None else None, dst
        )
        send_error: str | None = None
        if dst is not None:
            text = ack_in.numpy().tobytes()[:-1].decode(errors="replace")
            send_error = cannot or text or (None if sent_ok else "could not read every file")
        return send_error, kept, recv_error

    def _stream(
        self,
        files: Sequence[FileSpec],
        dst: int | None,
        incoming: _Incoming | None,
        src: int | None,
    ) -> bool:
        """The bytes both ways, one chunk each at a time; whether every read succeeded.

        One buffer per direction (at most :data:`CHUNK`), allocated once: the sender
        reads each chunk into its buffer, the receiver receives into its own and
        writes that memory, so no chunk is copied on either side.
        """
        out_sizes = [f.size for f in files] if dst is not None else []
        in_sizes = [n for _, n, _ in incoming.header] if incoming is not None else []
        out_buf = torch.empty(min(CHUNK, max(out_sizes, default=0)), dtype=torch.uint8)
        in_buf = torch.empty(min(CHUNK, max(in_sizes, default=0)), dtype=torch.uint8)
        out_mem, in_mem = out_buf.numpy().data, in_buf.numpy().data
        ok = True
        handles: dict[int, Any] = {}
        try:
            for mine, theirs in itertools.zip_longest(_chunks(out_sizes), _chunks(in_sizes)):
                out = inp = None
                if mine is not None:
                    i, start, length = mine
                    if ok:
                        try:
                            f = handles.get(i)
                            if f is None:
                                f = handles[i] = files[i].store.open_read(files[i].rel)
                            f.seek(start)
                            if f.readinto(out_mem[:length]) != length:
                                raise OSError(
                                    f"{files[i].path} is shorter than {files[i].size} bytes"
                                )
                        except OSError as exc:
                            ok = False
                            out_buf.zero_()  # zeros from here on: the receiver drops them
                            logger.warning("cannot send %s to rank %s: %s", files[i].path, dst, exc)
                    out = out_buf[:length]
                if theirs is not None:
                    inp = in_buf[: theirs[2]]
                self._pair(out, dst, inp, src)
                if theirs is not None and incoming is not None:
                    incoming.write(theirs[0], in_mem[: theirs[2]])
        finally:
            for f in handles.values():
                f.close()
        return ok


@dataclasses.dataclass(frozen=True)
class Peers:
    """The peers of one manager: the group files travel on and every rank's node.

    Built once at the manager's start on every rank (two collectives: the node map's
    all-gather and the group's creation), and shared by replication and restore.
    """

    group: PeerGroup
    nodes: NodeMap

    @classmethod
    def start(cls, collectives: Collectives, timeout: float, tier_path: str | None = None) -> Peers:
        nodes = node_map(collectives, tier_path)
        return cls(PeerGroup.create(collectives.group, timeout), nodes)
