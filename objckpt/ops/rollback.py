"""Rolling a run back: the steps above a chosen one, discarded on request, on every tier.

Why saves must not go below the newest step: retention ranks steps by number
(``keep_last`` keeps the highest) and a restart resumes from the highest. A job that
loads step 10 of a run holding 10, 15 and 20 (a loss spike after 10) and saves step
11 would have step 11 deleted by retention right after it commits, and every later
save below 15 the same way, while a restart would resume from step 20 of the run it
abandoned. Orbax skips such saves silently; objckpt refuses them before writing
anything (:class:`~objckpt.errors.StepOrderError`, naming both steps), and
:func:`discard_after` is the explicit way on: it deletes the committed steps above
the step the run goes back to, so the new run's steps are the newest again, kept by
retention and resumed from.

Every rank makes the same decisions from the same inputs: the order check compares
with the newest step of the catalog's last listing (which rank 0 makes and
broadcasts) and the steps every rank's ``save()`` calls started, and the discard
lists once on rank 0, which deletes on the root and the backups while every rank
deletes its own node's local-tier directories, then lists again for every rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from objckpt.dcp.collective import fail_together
from objckpt.errors import SaveDeadlineError, StoreError
from objckpt.format.steps import step_name
from objckpt.ops.catalog import StepCatalog, on_rank0
from objckpt.ops.durable import DurableSteps
from objckpt.ops.local_disk import delete_local_step, list_tier
from objckpt.ops.peers import replica_dir
from objckpt.ops.saving import SaveFlow
from objckpt.ops.tiers import LocalTier
from objckpt.pipeline.lifetime import run_bounded

__all__ = ["discard_after"]

logger = logging.getLogger(__name__)

#: Seconds a discard waits for the saves, promotions and backups in flight before
#: it refuses (on every rank): a promotion has no deadline of its own, and a rank
#: waiting for ever would leave the others in the discard's first collective.
SETTLE_TIMEOUT = 900.0


def discard_after(
    step: int,
    catalog: StepCatalog,
    durable: DurableSteps,
    saves: SaveFlow,
    local: LocalTier | None,
    process_group: Any | None,
) -> list[int]:
    """Every rank together: delete the committed steps above ``step`` on the root, the
    copy backups and the local tier; returns the steps discarded, ascending.

    Saves in flight and promotions are waited for first (their errors stay for
    ``check_for_errors``): a step landing after the deletion would come back.

    Raises:
        ConfigurationError: ``step`` is not an int >= 0.
        StoreError: A step above ``step`` could not be deleted (on every rank; calling
            again finishes the job).
    """
    step_name(step)  # validates the step
    failure: BaseException | None = None
    try:
        if not run_bounded(saves.settle, SETTLE_TIMEOUT, "saves before discard_after"):
            failure = SaveDeadlineError(
                f"saves or promotions to {catalog.root.url} still running after "
                f"{SETTLE_TIMEOUT:g} s; nothing was discarded (call discard_after again)"
            )
    except Exception as exc:
        failure = exc
    fail_together(failure, f"discarding the steps above {step}", process_group)
    catalog.reload()
    doomed = catalog.above(step)
    on_rank0(lambda: durable.discard_after(step, timeout=SETTLE_TIMEOUT), process_group)
    if local is not None:
        _discard_local(local, step)
    catalog.forget_after(step)
    catalog.reload()
    left = catalog.above(step)
    if left:
        raise StoreError(
            f"steps {left} above step {step} are still committed under {catalog.root.url} "
            "or its local tier after discarding them (see the log); call discard_after "
            "again"
        )
    if doomed:
        logger.warning(
            "discarded steps %s above step %d under %s: the run continues from step %d",
            doomed,
            step,
            catalog.root.url,
            step,
        )
    return doomed


def _discard_local(tier: LocalTier, step: int) -> None:
    """This rank's local directories of steps above ``step``, committed or not (never
    through a link; :mod:`objckpt.ops.local_disk`)."""
    root = tier.location.path
    listing = list_tier(root)
    if listing.error is not None:
        logger.warning("cannot list the local tier %s to discard steps: %s", root, listing.error)
        return
    # Replicas first: a replica of the coordinator's manifest would keep a discarded
    # step committed on this node (a restart would load it from the nodes).
    for s in sorted((s for s in listing.replicas_present if s > step), reverse=True):
        path = replica_dir(root, s)
        if delete_local_step(path):
            logger.info("discarded the replicas of local step %d at %s", s, path)
    for s in sorted((s for s in listing.present if s > step), reverse=True):
        path = os.path.join(root, step_name(s))
        if delete_local_step(path):
            logger.info("discarded local step %d at %s", s, path)
