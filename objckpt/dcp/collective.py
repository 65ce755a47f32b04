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
do); otherwise a gloo side group over the same ranks, created once (a CUDA-only
backend string on a machine without CUDA, e.g. ``cuda:gloo`` in tests, which
refuses CPU tensors exactly as NCCL does).

The side groups are the only state kept here: a process-wide map from a process
group's name to its side group, like torch's own registry of groups (a group is
process-wide state already, and building a second side group for it would be a
collective every rank must repeat).
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from objckpt._torch import has_cpu_backend
from objckpt.errors import ObjckptError, PeerRankError
from objckpt.writers.translate import describe

__all__ = [
    "Route",
    "all_gather_object",
    "all_reduce_max",
    "any_rank",
    "broadcast_bytes",
    "broadcast_from_rank0",
    "broadcast_object",
    "fail_together",
    "from_rank0_if_same",
    "gather_object",
    "is_distributed",
    "route",
]

T = TypeVar("T")

_SIDE_GROUPS: dict[str, Any] = {}
_SIDE_LOCK = threading.Lock()


def is_distributed() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a collective of one process group runs: which group, which device."""

    group: Any | None  # the group to pass to torch (the caller's, or its gloo side group)
    device: torch.device
    side_group: bool = False


def route(group: Any | None = None) -> Route:
    """Where ``group``'s collectives run (the default group when None)."""
    if has_cpu_backend(group):
        return Route(group, torch.device("cpu"))
    if torch.cuda.is_available():
        return Route(group, torch.device("cuda", torch.cuda.current_device()))
    return Route(_side_group(group), torch.device("cpu"), side_group=True)


def _side_group(group: Any | None) -> Any:
    """A gloo group over ``group``'s ranks, built the first time it is needed.

    Every rank of ``group`` reaches its first objckpt collective at the same point,
    so every rank builds the side group at the same point too.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ObjckptError("objckpt's collectives need torch.distributed's default group")
    name = pg.group_name
    with _SIDE_LOCK:
        side = _SIDE_GROUPS.get(name)
        if side is None:
            ranks = dist.get_process_group_ranks(pg)
            side = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=group is not None
            )
            _SIDE_GROUPS[name] = side
    return side


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an ObjckptError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ObjckptError(f"{type(exc).__name__}: {exc}")
    return exc


def _global(rank: int, group: Any | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def broadcast_object(obj: Any, src: int, group: Any | None = None) -> Any:
    """``obj`` from group rank ``src`` on every rank (a collective).

    Pickled: only for objckpt's own values (rank 0's decisions, item descriptions).
    """
    r = route(group)
    box = [obj]
    src_global = _global(src, group)
    dist.broadcast_object_list(box, src=src_global, group=r.group, device=r.device)
    return box[0]


def broadcast_bytes(buffer: bytearray, src: int, group: Any | None = None) -> None:
    """Fill ``buffer`` on every rank with group rank ``src``'s bytes, in place (a collective)."""
    if not buffer:
        return
    r = route(group)
    host = torch.frombuffer(buffer, dtype=torch.uint8)
    if r.device.type == "cpu":
        dist.broadcast(host, src=_global(src, group), group=r.group)
        return
    moved = host.to(r.device)
    dist.broadcast(moved, src=_global(src, group), group=r.group)
    host.copy_(moved.cpu())


def all_gather_object(obj: Any, group: Any | None = None) -> list[Any]:
    """Every rank's ``obj``, in group rank order, on every rank (a collective).

    Pickled: only for objckpt's own small values (what each rank found on its disk).
    """
    r = route(group)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=r.group)
    return out


def gather_object(obj: Any, group: Any | None = None) -> list[Any] | None:
    """Every rank's ``obj`` in group rank order on group rank 0, None on the others
    (a collective): for answers only rank 0 decides on, so that no rank receives
    W answers it does not need.

    Pickled: only for objckpt's own small values.
    """
    r = route(group)
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(obj, out, dst=_global(0, group), group=r.group)
    return out


def all_reduce_max(values: Sequence[int], group: Any | None = None) -> list[int]:
    """The element-wise maximum of ``values`` over the group (one all-reduce)."""
    r = route(group)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=r.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=r.group)
    return [int(v) for v in tensor.tolist()]


def broadcast_from_rank0(fn: Callable[[], T], process_group: Any | None = None) -> T:
    """Run ``fn`` on rank 0 of ``process_group``; every rank returns its result.

    A collective: every rank of the group must call it at the same point.

    Raises:
        Exception: ``fn``'s error, on every rank (rank 0 raises the original).
    """
    _, value = from_rank0_if_same("", fn, process_group)  # one key: every rank takes it
    return cast(T, value)


def from_rank0_if_same(
    key: str, fn: Callable[[], T], process_group: Any | None = None
) -> tuple[bool, T | None]:
    """``fn()`` run on rank 0 of ``process_group``, for the ranks whose ``key`` is rank 0's.

    A collective: every rank of the group must call it at the same point. Ranks may
    name different keys (each loading a checkpoint of its own, say): a rank whose
    ``key`` differs from rank 0's gets ``(False, None)`` and does the work itself.

    Returns:
        ``(True, rank 0's result)``, or ``(False, None)`` where rank 0's key differs.

    Raises:
        Exception: ``fn``'s error, on rank 0 and every rank with the same key.
    """
    rank = dist.get_rank(process_group)
    error: BaseException | None = None
    payload: Any = None
    if rank == 0:
        try:
            payload = (key, True, fn())
        except Exception as exc:
            error = exc
            payload = (key, False, _portable(exc))
    src_key, ok, value = broadcast_object(payload, 0, process_group)
    if error is not None:
        raise error
    if src_key != key:
        return False, None
    if not ok:
        raise value
    return True, value


def any_rank(flag: bool, process_group: Any | None = None) -> bool:
    """Whether ``flag`` is true on any rank of the group (one all-reduce of one int).

    A collective: every rank of the group must call it at the same point.
    """
    if not is_distributed():
        return flag
    return bool(all_reduce_max([1 if flag else 0], process_group)[0])


def fail_together(error: BaseException | None, what: str, group: Any | None = None) -> None:
    """End a step each rank took on its own with one outcome for the group: when
    any rank's ``error`` is set, every rank raises (the lowest failing rank's cause
    named on the others), so no rank goes on into a collective the failed ones will
    never reach. Without a process group, ``error`` is raised as it is.

    A collective (one all-reduce, and one broadcast only on failure): every rank of
    the group must call it at the same point.

    Raises:
        BaseException: this rank's own ``error``.
        PeerRankError: another rank failed ``what`` (its rank and error named).
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    # The lowest failing rank, as the largest (world - rank): a stable choice of whose
    # cause the others name.
    top = all_reduce_max([world - rank if error is not None else 0], group)[0]
    if top == 0:
        return
    failed = world - top
    mine = describe(error) if error is not None and rank == failed else None
    cause = broadcast_object(mine, failed, group)
    if error is not None:
        raise error
    raise PeerRankError(f"{what} failed on rank {failed}: {cause}", rank=failed)
