"""Decide once on rank 0, tell every rank: the one pattern that keeps ranks agreeing.

Anything every rank would otherwise do on its own against the store — read a
manifest, list a root, pick the latest step, choose a backup to fall back to — costs
W requests per job and can give W different answers when the store changes in
between (a step committing between two ranks' listings). Run on rank 0 and
broadcast, it costs one request and gives one answer. Errors travel too: when
rank 0 fails, every rank raises the same error instead of some ranks hanging in a
collective the others never reach.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from objckpt.errors import ObjckptError

__all__ = ["any_rank", "broadcast_from_rank0", "is_distributed"]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an ObjckptError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ObjckptError(f"{type(exc).__name__}: {exc}")
    return exc


def broadcast_from_rank0(fn: Callable[[], T], process_group: Any | None = None) -> T:
    """Run ``fn`` on rank 0 of ``process_group``; every rank returns its result.

    A collective: every rank of the group must call it at the same point.

    Raises:
        Exception: ``fn``'s error, on every rank (rank 0 raises the original).
    """
    rank = dist.get_rank(process_group)
    error: BaseException | None = None
    payload: Any = None
    if rank == 0:
        try:
            payload = (True, fn())
        except Exception as exc:
            error = exc
            payload = (False, _portable(exc))
    box = [payload]
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(box, src=src, group=process_group)
    ok, value = box[0]
    if error is not None:
        raise error
    if not ok:
        raise value
    result: T = value
    return result


def any_rank(flag: bool, process_group: Any | None = None) -> bool:
    """Whether ``flag`` is true on any rank of the group (one all-reduce of one int).

    A collective: every rank of the group must call it at the same point.
    """
    if not is_distributed():
        return flag
    device = "cpu"
    if dist.get_backend(process_group) == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=process_group)
    return bool(value.item())
