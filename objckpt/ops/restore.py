"""Restore: load one step, each object from the first source that holds it intact.

A step can be read from three places: this node's local tier (fast, but only the
objects this node wrote), the primary root, and the backups. The primary is tried
first, then each backup in order; whichever root is read, every object this node's
local copy holds intact is read from disk instead. A step missing on a root, a
damaged object, or an unreachable store moves the load to the next root.

In a process group every rank must load together: rank 0 lists and picks the step,
reads each manifest once and shares it, and a failure on any rank fails every rank
alike, so all ranks move to the same next source and load the same step from the
same place.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp

from objckpt.dcp.collective import is_distributed
from objckpt.dcp.load_planner import LoadPlanner
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StateDictMismatchError,
    StoreError,
)
from objckpt.format.steps import step_name
from objckpt.ops.catalog import StepCatalog, on_rank0
from objckpt.ops.torch_errors import size_mismatch, unwrap
from objckpt.options import ReadOptions
from objckpt.writers.retry import RetryPolicy

__all__ = ["Restorer"]

logger = logging.getLogger(__name__)

# What moves a load to the next source (anything else is the caller's mistake).
_SOURCE_FAILED = (CheckpointNotFoundError, IntegrityError, ManifestError, StoreError)


class Restorer:
    """Loads steps of the run ``catalog`` describes.

    Args:
        catalog: Where steps live (root, local tier, backups) and which exist.
        retry: How every store request is retried.
        process_group: The group that loads together.
    """

    def __init__(
        self, catalog: StepCatalog, *, retry: RetryPolicy, process_group: Any | None = None
    ) -> None:
        self._catalog = catalog
        self._retry = retry
        self._group = process_group

    def load(self, state_dict: dict[str, Any], step: int | None, read: ReadOptions | None) -> int:
        """Load ``step`` (the newest on any tier when None, falling back to the newest
        durable one) into ``state_dict`` in place; returns the step loaded."""
        if step is not None:
            return self._load_step(step, state_dict, read)
        newest, durable = on_rank0(self._catalog.newest, self._group)
        try:
            return self._load_step(newest, state_dict, read)
        except _SOURCE_FAILED as exc:
            if durable is None or durable == newest:
                raise
            logger.warning(
                "step %d (local tier) cannot be loaded everywhere (%s); loading step %d, "
                "the newest durable one",
                newest,
                exc,
                durable,
            )
            return self._load_step(durable, state_dict, read)

    def _load_step(self, step: int, state_dict: dict[str, Any], read: ReadOptions | None) -> int:
        """Load ``step`` from the root, then each backup: every object from this
        node's local copy first when there is one."""
        local = self._catalog.local_step_url(step)
        roots = [self._catalog.root] + [b.location for b in self._catalog.backups]
        failures: list[BaseException] = []
        for i, root in enumerate(roots):
            url = root.child(step_name(step)).url
            try:
                self._load_from(url, root.storage_options, state_dict, read, local)
            except _SOURCE_FAILED as exc:
                failures.append(exc)
                if i + 1 < len(roots):
                    logger.warning(
                        "cannot load step %d from %s (%s); trying its backup", step, url, exc
                    )
                continue
            if i:
                logger.warning(
                    "loaded step %d from backup %s because the primary failed: %s",
                    step,
                    url,
                    failures[0],
                )
            return step
        if len(failures) > 1:
            failures[0].add_note(
                "backups tried: " + "; ".join(f"{type(e).__name__}: {e}" for e in failures[1:])
            )
        raise failures[0]

    def _load_from(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        state_dict: dict[str, Any],
        read: ReadOptions | None,
        local: str | None = None,
    ) -> None:
        distributed = is_distributed()
        # With a group, rank 0 reads the manifest and the others receive it: one GET
        # per job, and a missing or damaged manifest fails every rank alike, so all
        # ranks move to the same backup together.
        reader = ObjectStoreReader(
            url,
            storage_options=storage_options,
            read=read,
            retry=self._retry,
            broadcast=distributed,
            process_group=self._group,
            allow_stock=False,  # a step exists only once its manifest is committed
            local=local,
        )
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state_dict,
                    storage_reader=reader,
                    planner=LoadPlanner(),  # plans from the chunk runs: flat in W
                    process_group=self._group,
                    no_dist=not distributed,
                )
        except BaseException as exc:
            logger.info("load of %s failed on this rank after %s", url, reader.requests.summary())
            mismatch = size_mismatch(exc)
            if mismatch is not None:
                raise StateDictMismatchError(
                    f"the state dict does not fit {url}: {mismatch}"
                ) from exc
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        logger.info(
            "loaded %s; this rank's load cost %s%s",
            url,
            reader.requests.summary(),
            f" and {reader.local_bytes_read} bytes from {local}" if local else "",
        )
