"""Seeing through torch's ``CheckpointException`` to the error a rank raised.

``dcp.save`` and ``dcp.load`` wrap whatever a rank raised in one
``CheckpointException`` that maps ranks to (error, traceback) pairs. The manager
raises the objckpt error inside instead (a caller catches ``IntegrityError``, not
torch's wrapper), and names the checkpoint when torch's own planner error does not.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from objckpt.errors import ObjckptError

__all__ = ["first_of", "size_mismatch", "unwrap"]


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank errors torch's ``CheckpointException`` carries, else ``[exc]``."""
    if not isinstance(exc, CheckpointException):
        return [exc]
    # torch stores (exception, traceback frames) per rank
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def unwrap(exc: BaseException) -> BaseException:
    """The objckpt error torch's ``CheckpointException`` carries, else ``exc``."""
    return next((e for e in _failures(exc) if isinstance(e, ObjckptError)), exc)


def first_of(exc: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first per-rank error torch's ``CheckpointException`` carries (in rank
    order, the same on every rank) that is one of ``types``, else None."""
    return next((e for e in _failures(exc) if isinstance(e, types)), None)


def size_mismatch(exc: BaseException) -> BaseException | None:
    """torch's planner error for a load target whose shape differs ("Size mismatch
    between saved ... and current ... for <key>"), which does not say which
    checkpoint it was; the caller re-raises it naming the step."""
    return next(
        (e for e in _failures(exc) if type(e) is ValueError and str(e).startswith("Size mismatch")),
        None,
    )
