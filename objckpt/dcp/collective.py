"""Every collective objckpt makes, on whatever device the process group supports.

Two jobs, one module, because they are the same question asked twice:

**Decide once on rank 0, tell every rank.** Anything every rank would otherwise do
on its own against the store — read a manifest, list a root, pick the latest step,
choose a backup to fall back to — costs W requests per job and can give W different
answers when the store changes in between (a step committing between two ranks'
listings). Run on rank 0 and broadcast, it costs one request and gives one answer.
Errors travel too: when rank 0 fails, every rank raises the same error instead of
some ranks hanging in a collective the others never reach.

**Run on the group's device.** A job that calls ``init_process_group("nccl")`` has
no CPU backend: a CPU tensor in a collective fails there ("No backend type
associated with device type cpu"), and torch's object collectives move their bytes
through CUDA. :class:`Route` picks, once per process group: CPU tensors when the
group has a CPU backend (gloo, or ``cpu:gloo,cuda:nccl``); CUDA tensors on the
current device when it has none and CUDA is there (as DCP's own object collectives
do); otherwise a gloo side group over the same ranks (a CUDA-only backend string on a
machine without CUDA, e.g. ``cuda:gloo`` in tests, which refuses CPU tensors
exactly as NCCL does).

**State is owned.** :class:`Collectives` is the collectives of one process group,
built once by what makes them (a checkpointer, a manager, a reader), and it owns
its side group: built at its first collective that needs one, which every rank
reaches at the same point, since every rank makes its owner's collectives in the
same order. Nothing is kept at module level. :func:`side_group` is the one builder
of a gloo group over a group's ranks: the side groups here and the peers' wire
(:class:`objckpt.ops.tier.peers.PeerGroup`, with its own timeout) both come from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from objckpt._torch import has_cpu_backend
from objckpt.errors import ObjckptError, PeerRankError
from objckpt.writers.translate import describe

__all__ = ["Collectives", "Route", "is_distributed", "side_group"]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a collective of one process group runs: which group, which device."""

    group: Any | None  # the group to pass to torch (the caller's, or its gloo side group)
    device: torch.device
    side_group: bool = False


def side_group(group: Any | None, timeout: float | None = None) -> Any:
    """A new gloo group over ``group``'s ranks (the default group when None).

    A collective, like any ``new_group``: every rank of ``group`` (of the default
    group, when None) must call it at the same point.

    Args:
        group: The group whose ranks the new one spans.
        timeout: Seconds its collectives wait (None: torch's default).

    Raises:
        ObjckptError: torch.distributed has no default group.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ObjckptError("objckpt's collectives need torch.distributed's default group")
    extra: dict[str, Any] = {}
    if timeout is not None:
        extra["timeout"] = datetime.timedelta(seconds=timeout)
    return dist.new_group(
        ranks=dist.get_process_group_ranks(pg),
        backend="gloo",
        use_local_synchronization=group is not None,
        **extra,
    )


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an ObjckptError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ObjckptError(f"{type(exc).__name__}: {exc}")
    return exc


class Collectives:
    """The collectives objckpt makes on one process group, and the side group they
    may need.

    Every method is a collective: every rank of the group must call it at the same
    point. Pickled values are only objckpt's own (rank 0's decisions, item
    descriptions, what each rank found on its disk).

    Args:
        group: The process group (None: the default group, looked up at each call).
    """

    def __init__(self, group: Any | None = None) -> None:
        self.group = group
        self._side: Any | None = None
        self._lock = threading.Lock()

    def route(self) -> Route:
        """Where the group's collectives run (its side group is built here, the first
        time one is needed)."""
        if has_cpu_backend(self.group):
            return Route(self.group, torch.device("cpu"))
        if torch.cuda.is_available():
            return Route(self.group, torch.device("cuda", torch.cuda.current_device()))
        with self._lock:
            if self._side is None:
                self._side = side_group(self.group)
        return Route(self._side, torch.device("cpu"), side_group=True)

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 without torch.distributed)."""
        return int(dist.get_rank(self.group)) if is_distributed() else 0

    @property
    def world(self) -> int:
        """The group's size (1 without torch.distributed)."""
        return int(dist.get_world_size(self.group)) if is_distributed() else 1

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` from group rank ``src`` on every rank."""
        r = self.route()
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=r.group, device=r.device)
        return box[0]

    def broadcast_bytes(self, buffer: bytearray, src: int) -> None:
        """Fill ``buffer`` on every rank with group rank ``src``'s bytes, in place."""
        if not buffer:
            return
        r = self.route()
        host = torch.frombuffer(buffer, dtype=torch.uint8)
        if r.device.type == "cpu":
            dist.broadcast(host, src=self._global(src), group=r.group)
            return
        moved = host.to(r.device)
        dist.broadcast(moved, src=self._global(src), group=r.group)
        host.copy_(moved.cpu())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group rank order, on every rank."""
        r = self.route()
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=r.group)
        return out

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in group rank order on group rank 0, None on the others:
        for answers only rank 0 decides on, so that no rank receives W answers it does
        not need."""
        r = self.route()
        rank = dist.get_rank(self.group)
        out: list[Any] | None = [None] * dist.get_world_size(self.group) if rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=r.group)
        return out

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the group (one all-reduce)."""
        r = self.route()
        tensor = torch.tensor(list(values), dtype=torch.int64, device=r.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=r.group)
        return [int(v) for v in tensor.tolist()]

    def from_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 of the group; every rank returns its result (a plain
        call without torch.distributed).

        Raises:
            Exception: ``fn``'s error, on every rank (rank 0 raises the original).
        """
        if not is_distributed():
            return fn()
        _, value = self.from_rank0_if_same("", fn)  # one key: every rank takes it
        return cast(T, value)

    def from_rank0_if_same(self, key: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """``fn()`` run on rank 0 of the group, for the ranks whose ``key`` is rank 0's.

        Ranks may name different keys (each loading a checkpoint of its own, say): a
        rank whose ``key`` differs from rank 0's gets ``(False, None)`` and does the
        work itself.

        Returns:
            ``(True, rank 0's result)``, or ``(False, None)`` where rank 0's key differs.

        Raises:
            Exception: ``fn``'s error, on rank 0 and every rank with the same key.
        """
        rank = dist.get_rank(self.group)
        error: BaseException | None = None
        payload: Any = None
        if rank == 0:
            try:
                payload = (key, True, fn())
            except Exception as exc:
                error = exc
                payload = (key, False, _portable(exc))
        src_key, ok, value = self.broadcast_object(payload, 0)
        if error is not None:
            raise error
        if src_key != key:
            return False, None
        if not ok:
            raise value
        return True, value

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of the group (one all-reduce of one
        int; ``flag`` itself without torch.distributed)."""
        if not is_distributed():
            return flag
        return bool(self.all_reduce_max([1 if flag else 0])[0])

    def fail_together(self, error: BaseException | None, what: str) -> None:
        """End a step each rank took on its own with one outcome for the group: when
        any rank's ``error`` is set, every rank raises (the lowest failing rank's
        cause named on the others), so no rank goes on into a collective the failed
        ones will never reach. Without torch.distributed, ``error`` is raised as it is.

        One all-reduce, and one broadcast only on failure.

        Raises:
            BaseException: this rank's own ``error``.
            PeerRankError: another rank failed ``what`` (its rank and error named).
        """
        if not is_distributed():
            if error is not None:
                raise error
            return
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        # The lowest failing rank, as the largest (world - rank): a stable choice of
        # whose cause the others name.
        top = self.all_reduce_max([world - rank if error is not None else 0])[0]
        if top == 0:
            return
        failed = world - top
        mine = describe(error) if error is not None and rank == failed else None
        cause = self.broadcast_object(mine, failed)
        if error is not None:
            raise error
        raise PeerRankError(f"{what} failed on rank {failed}: {cause}", rank=failed)
