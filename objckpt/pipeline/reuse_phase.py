"""The base of an async save with reuse: one for every rank, read in the background.

Rank 0 chooses the base step (a manager's catalog, or the caller's ``reuse_from``)
and its number travels in the save's agreement (:func:`objckpt.pipeline.plan_cache.agree`),
as rank 0's answer to "already committed?" does: every rank then references the
one step rank 0 holds against retention (``DurableSteps.hold_base``), never a step
that only its own catalog still lists.

The base's reads (its manifest and this rank's index object, none when this
process remembers what it wrote there, then a HEAD of each object this rank would
reference) start right after the agreement, on a thread of their own (never the
checker thread that answers the next save's "already committed?"), bounded by half
the save's deadline: a store that stalls them costs the reuse of this save, never
the save (the lookup inside DCP's collective waits for them only until then,
:meth:`BaseReader.table`). They get half the save's deadline, so that a save that
gives up its reuse has the other half to upload everything.
"""

from __future__ import annotations

import contextvars
import logging
import threading

from objckpt.dcp.reuse_base import base_location
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.format.ref_check import sibling
from objckpt.format.steps import parse_step, step_name
from objckpt.pipeline.reuse_memory import ReuseMemory
from objckpt.writers.deadline import Deadline

__all__ = ["adopt_base", "proposed_base"]

logger = logging.getLogger(__name__)

#: The share of the save's deadline (``UploadOptions.deadline``) its base reads may
#: take: past it the save reuses nothing and still has the rest to upload everything.
BASE_SHARE = 0.5


def proposed_base(target: ObjectStoreWriter | None) -> int | None:
    """The base step this rank proposes (only rank 0's counts): ``reuse_from``'s number."""
    if target is None or target.reuse_from is None:
        return None
    return parse_step(target.reuse_from.rstrip("/"))


def adopt_base(target: ObjectStoreWriter, base: int | None, rank: int, memory: ReuseMemory) -> None:
    """Use the agreed ``base`` step (None: no reuse) for this save, and start reading
    what this rank needs of it on a thread of its own, bounded by half the save's
    deadline (:data:`BASE_SHARE`).

    A rank whose own ``reuse_from`` named another step (its catalog lagged or led
    rank 0's) takes rank 0's: its step directory beside the save's.

    Runs after the agreement, where no rank may leave alone: anything that fails
    here (a thread that cannot start, a base that cannot be opened) costs only this
    rank's reuse, with a warning, never the save.
    """
    try:
        _adopt(target, base, rank, memory)
    except Exception as exc:
        target.reuse_from = None
        logger.warning("rank %d reuses nothing in this save (base step %s: %s)", rank, base, exc)


def _adopt(target: ObjectStoreWriter, base: int | None, rank: int, memory: ReuseMemory) -> None:
    if base is None:
        target.reuse_from = None
        return
    url = sibling(target.location, step_name(base)).url
    if target.reuse_from is None or target.reuse_from.rstrip("/") != url:
        if target.reuse_from is not None:
            logger.info("rank %d reuses from %s, rank 0's base", rank, url)
        target.reuse_from = url
        base_location(target.location, url)  # a sibling step by construction
    reader = target.base_reader()
    if reader is None:
        return
    known = memory.recall(url)
    if known is not None:  # the step this process committed last: only HEADs to make
        reader.remember(known)
    elif (loaded := memory.loaded_manifest(url)) is not None:  # the step loaded last
        reader.given(loaded)
    budget = target.upload.deadline
    deadline = Deadline.start(
        None if budget is None else budget * BASE_SHARE,
        f"half the deadline of rank {rank}'s save",
    )
    reader.bound(deadline)
    ctx = contextvars.copy_context()
    threading.Thread(
        target=ctx.run,
        args=(reader.prefetch, rank),
        name=f"objckpt-base-{base}",
        daemon=True,
    ).start()
