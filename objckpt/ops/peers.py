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
  sender's error), the bytes in chunks of :data:`CHUNK` (the memory each side
  holds), the sender's trailer (did every read succeed), and the receiver's ack.
  Both sides walk all of it whatever fails (a read error sends zeros, a full disk
  receives and drops), so one side's failure never leaves the other blocked; only
  a dead or stuck peer does, until the group's timeout. A received file is
  checked against its CRC32C before it is renamed into place: a damaged copy is
  never kept.

Where a node keeps other nodes' files: ``<tier>/replicas/step-<N>/<key>``, never
in its own step directories, so a replica is never mistaken for the node's own
part (nor listed as a step committed on this node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from objckpt.dcp.collective import all_gather_object, is_distributed
from objckpt.errors import ObjckptError, PeerSilentError
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_entropy_dir, is_objckpt_object
from objckpt.format.steps import parse_step, step_name
from objckpt.writers.checksum import Crc32c
from objckpt.writers.translate import describe

__all__ = [
    "CHUNK",
    "REPLICAS_DIR",
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

#: The directory under a tier's path that holds other nodes' files.
REPLICAS_DIR = "replicas"
#: Bytes per point-to-point message: what a transfer holds in memory on each side.
CHUNK = 16 << 20


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
    """

    names: tuple[str, ...]
    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    problem: str | None = None

    @property
    def nodes(self) -> int:
        return len(self.names)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def rounds_for(self, replicas: int, jump: int) -> list[dict[int, int]]:
        """The replication rounds: each a map sender rank -> receiver rank, one per
        k with a target other than the sender's own node (the same for every node,
        since the jump is)."""
        if self.problem is not None or self.nodes < 2:
            return []
        out: list[dict[int, int]] = []
        seen: set[int] = set()
        for k in range(1, replicas):
            shift = (k * jump) % self.nodes
            if shift == 0 or shift in seen:
                continue
            seen.add(shift)
            pairs = {}
            for rank, node in enumerate(self.node_of):
                target = self.ranks_on((node + shift) % self.nodes)
                pairs[rank] = target[self.local_of[rank]]
            out.append(pairs)
        return out

    def effective_replicas(self, replicas: int, jump: int) -> int:
        """How many nodes hold each node's files (its own included)."""
        return 1 + len(self.rounds_for(replicas, jump))


def node_map(process_group: Any | None) -> NodeMap:
    """Every rank's node, all-gathered (a collective on ``process_group``)."""
    if not is_distributed():
        name, _ = _node_identity()
        return NodeMap((name,), (0,), (0,))
    views = all_gather_object(_node_identity(), process_group)
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
    return NodeMap(tuple(names), node_of, tuple(local_of), problem)


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


def files_in(step_dir: str) -> dict[str, int]:
    """objckpt's objects under ``step_dir`` (and its entropy sub-directories), by key,
    with sizes; nothing through a link."""
    found: dict[str, int] = {}
    if os.path.islink(step_dir):
        return found
    with contextlib.suppress(FileNotFoundError), os.scandir(step_dir) as entries:
        for e in entries:
            if e.is_file(follow_symlinks=False):
                if e.name in (MANIFEST_KEY, METADATA_KEY) or is_objckpt_object(e.name):
                    found[e.name] = e.stat(follow_symlinks=False).st_size
            elif e.is_dir(follow_symlinks=False) and is_entropy_dir(e.name):
                with os.scandir(e.path) as inner:
                    for f in inner:
                        if f.is_file(follow_symlinks=False) and is_objckpt_object(f.name):
                            found[f"{e.name}/{f.name}"] = f.stat(follow_symlinks=False).st_size
    return found


def _read_manifest(path: str) -> bytes | None:
    try:
        if os.lstat(path).st_size > DEFAULT_MAX_METADATA_BYTES:
            logger.warning("local tier: %s is too large to be a manifest; ignored", path)
            return None
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def list_holdings(tier_path: str, steps: Iterable[int] | None = None) -> Holdings:
    """What this rank's tier holds (of ``steps`` only, when given); a listing that
    fails is reported in the answer, never raised (it is shared in a collective)."""
    wanted = None if steps is None else set(steps)
    objects: dict[int, dict[str, int]] = {}
    manifests: dict[int, bytes] = {}
    try:
        dirs: list[tuple[int, str]] = []
        for base in (tier_path, os.path.join(tier_path, REPLICAS_DIR)):
            if os.path.islink(base):
                continue
            with contextlib.suppress(FileNotFoundError), os.scandir(base) as entries:
                for e in entries:
                    step = parse_step(e.name)
                    if step is None or not e.is_dir(follow_symlinks=False):
                        continue
                    if wanted is None or step in wanted:
                        dirs.append((step, e.path))
        for step, path in dirs:
            files = files_in(path)
            if MANIFEST_KEY in files and step not in manifests:
                data = _read_manifest(os.path.join(path, MANIFEST_KEY))
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
    """One file on the wire: its key, where the sender reads it, its size and CRC32C."""

    key: str
    path: str
    size: int
    crc32c: str


def _chunks(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every message a stream of files of ``sizes``
    takes; both sides compute it from the header."""
    out = []
    for i, size in enumerate(sizes):
        for start in range(0, size, CHUNK):
            out.append((i, start, min(CHUNK, size - start)))
    return out


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


class _Incoming:
    """Files being received into one directory: each into a temporary file, checked
    and renamed into place at the end; after the first write error the rest is
    received and dropped (the stream must be walked to its end)."""

    def __init__(self, into: str, header: list[tuple[str, int, str]]) -> None:
        self.into = into
        self.header = header
        self.error: str | None = None
        self._tmp: dict[int, str] = {}
        self._files: dict[int, Any] = {}
        self._crc: dict[int, Crc32c] = {}

    def _open(self, i: int) -> Any:
        f = self._files.get(i)
        if f is None:
            key = self.header[i][0]
            final = os.path.join(self.into, key)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            head, tail = os.path.split(final)
            tmp = os.path.join(head, f".{tail}.{uuid.uuid4().hex}.tmp")
            f = open(tmp, "xb")  # noqa: SIM115 (closed in finish/abort)
            self._tmp[i], self._files[i], self._crc[i] = tmp, f, Crc32c()
        return f

    def write(self, i: int, data: memoryview) -> None:
        if self.error is not None:
            return
        try:
            self._open(i).write(data)
            self._crc[i].update(data)
        except OSError as exc:
            self.error = (
                f"cannot write {os.path.join(self.into, self.header[i][0])}: {describe(exc)}"
            )

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
                if got != crc:
                    self.error = f"{key}: received CRC32C {got}, the sender's manifest says {crc}"
                    break
            for f in self._files.values():
                f.flush()
                f.close()
            if self.error is None:
                for i, (key, _, _) in enumerate(self.header):
                    os.replace(self._tmp[i], os.path.join(self.into, key))
                    kept.append(key)
        except OSError as exc:
            self.error = self.error or f"cannot keep the files in {self.into}: {describe(exc)}"
        finally:
            for f in self._files.values():
                with contextlib.suppress(OSError):
                    f.close()
            if self.error is not None:
                for tmp in self._tmp.values():
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        return kept


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
        it, like any ``new_group``); None inside without torch.distributed."""
        if not is_distributed():
            return cls(None, timeout)
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        # The group's collectives (a step's agreement) wait twice a step's bound: the
        # ranks done first wait there for a pair that is slow but within its bound.
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=2 * timeout),
            use_local_synchronization=process_group is not None,
        )
        return cls(group, timeout)

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
                if seconds <= 0:
                    raise RuntimeError("the step's time was up")
                w.wait(datetime.timedelta(seconds=seconds))
            except RuntimeError as exc:
                raise PeerSilentError(
                    f"rank {peer} {what} nothing within {seconds:.0f} s: {exc}", rank=peer
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
            RuntimeError: A peer did not answer within the timeout (dead or stuck).
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
        size = self._int(len(blob), dst, src)
        inp = torch.zeros(size if src is not None else 0, dtype=torch.uint8)
        self._pair(torch.frombuffer(blob, dtype=torch.uint8) if blob else None, dst, inp, src)
        incoming: _Incoming | None = None
        recv_error: str | None = None
        theirs: list[tuple[str, int, str]] = []
        if recv is not None:
            try:
                got = json.loads(inp.numpy().tobytes())
                recv_error = got.get("error")
                if (got.get("step"), got.get("seq")) != (step, seq):
                    recv_error = (
                        f"rank {src} sent step {got.get('step')} (#{got.get('seq')}) while "
                        f"this rank expected step {step} (#{seq}); its bytes were dropped"
                    )
                listed = [(k, int(n), str(c)) for k, n, c in got.get("files", [])]
            except (ValueError, TypeError) as exc:
                recv_error = f"the sender's header is unreadable: {exc}"
                listed = []
            try:
                theirs = [(_safe_key(k), n, c) for k, n, c in listed]
            except ObjckptError as exc:  # its bytes are still received (and dropped)
                recv_error = recv_error or str(exc)
                theirs = [("", n, c) for _, n, c in listed]
            incoming = _Incoming(recv[1], theirs)
            incoming.error = recv_error
        sent_ok = self._stream(files, dst, incoming, src)
        their_ok = bool(self._int(int(sent_ok), dst, src))
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
        """The bytes both ways, one chunk each at a time; whether every read succeeded."""
        out_plan = _chunks([f.size for f in files]) if dst is not None else []
        in_plan = _chunks([n for _, n, _ in incoming.header]) if incoming is not None else []
        ok = True
        handles: dict[int, Any] = {}
        try:
            for n in range(max(len(out_plan), len(in_plan))):
                out = inp = None
                if n < len(out_plan):
                    i, start, length = out_plan[n]
                    buf = bytearray(length)
                    if ok:
                        try:
                            f = handles.get(i)
                            if f is None:
                                f = handles[i] = open(files[i].path, "rb")  # noqa: SIM115
                            f.seek(start)
                            if f.readinto(buf) != length:
                                raise OSError(
                                    f"{files[i].path} is shorter than {files[i].size} bytes"
                                )
                        except OSError as exc:
                            ok = False
                            logger.warning("cannot send %s to rank %s: %s", files[i].path, dst, exc)
                    out = torch.frombuffer(buf, dtype=torch.uint8)
                if n < len(in_plan):
                    inp = torch.empty(in_plan[n][2], dtype=torch.uint8)
                self._pair(out, dst, inp, src)
                if inp is not None and incoming is not None:
                    incoming.write(in_plan[n][0], memoryview(inp.numpy().data))
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
    def start(cls, process_group: Any | None, timeout: float) -> Peers:
        nodes = node_map(process_group)
        return cls(PeerGroup.create(process_group, timeout), nodes)
