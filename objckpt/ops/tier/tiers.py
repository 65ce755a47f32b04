"""The local tier: checkpoints on this node's disk first, the object store later.

Why two tiers: a save that commits to node-local NVMe (or ``/dev/shm``) in
seconds can run every few minutes, while the object store receives every K-th
step in the background. A restart reads what this node still holds and fetches
only the rest from the store.

The local tier uses the same protocol as the store: a step exists there once
its ``manifest.json`` is committed (create-only, every object with its CRC32C),
under ``<path>/step-<10 digits>/``. In a job spread over several nodes each rank
writes its payload objects into its own node's ``path``; the coordinator's copy
also holds the manifest, ``.metadata`` and the index objects. A step is
*durable* only once the primary root's manifest for it is committed.

This module holds the values (:class:`LocalTier`, :class:`TierStatus`) and the
checks the manager makes before a local save (can this node write there, is there
room?), and recognises the failures that turn the tier off instead of failing a
training step (a full disk, a tier that refuses writes).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from objckpt._removed import LOCAL_TIER, removed_keywords
from objckpt.errors import ConfigurationError
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.writers.location import Location
from objckpt.writers.node_store import NodeStore
from objckpt.writers.translate import causes

__all__ = [
    "LocalTier",
    "TierStatus",
    "is_disk_full",
    "is_not_writable",
    "local_room",
    "state_bytes",
]

logger = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_FULL_TEXT = tuple(os.strerror(e) for e in _FULL)
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)
_REFUSED_TEXT = tuple(os.strerror(e) for e in _REFUSED)


#: A local tier's default: the newest 2 local steps (the one a restart resumes from, and
#: the one before it, while the next save writes).
_LOCAL_RETENTION = RetentionPolicy(keep_last=2)


def _positive_int(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(
            f"LocalTier option {name}={value!r} is invalid: expected an int >= 1"
            + (" or None" if allow_none else "")
        )


@removed_keywords(LOCAL_TIER)
@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A node-local directory every save commits to before the object store.

    Attributes:
        path: This process's local directory (``/local_nvme/ckpt``, ``/dev/shm/ckpt``
            or ``file://...``). Ranks on different nodes each use their own; ranks on
            one node may share one.
        retention: Which local steps each rank's directory keeps
            (:class:`~objckpt.RetentionPolicy`, the same value the root takes;
            default: the newest 2). One value per concern: the tier's disk is
            sized by it as the root is by its own. A step picked for promotion is
            kept until it is durable whatever the policy says, and so is a step
            whose replication is running; steps ``promote_every`` does not pick are
            deleted by the policy alone, and the log says they were never durable.
        promote_every: Every K-th committed local save is promoted to the primary
            root (1: every save). ``CheckpointManager.save(..., promote=True)``
            promotes one save whatever K says.
        min_free_bytes: Room to leave free on the local disk. A save whose bytes
            would not fit above it goes to the object store directly (with a
            warning) instead of failing.
        replicas: How many nodes hold each node's files of a local step (1: only
            its own). With R >= 2, after a local save commits, every node sends its
            files to R - 1 other nodes (:mod:`objckpt.ops.tier.peers`), off the training
            thread, so a restart after losing a node resumes from the newest local
            step, taking that node's part from a peer instead of falling back to
            the newest durable step. A node is what torchrun says (``GROUP_RANK``,
            ``LOCAL_WORLD_SIZE``), else its host name.
        replica_jump: Node g's files go to nodes g + k * replica_jump (mod the node
            count), k = 1 .. R - 1: with nodes numbered along racks, the rack size
            puts every replica in another rack (NVIDIA's resiliency extension calls
            this the replication jump).
        replication_timeout: Seconds one step's replication may take, all its
            exchanges together: the tier's own bound (a save's
            ``AsyncOptions.barrier_timeout`` bounds the save, not its replication). A pair
            still within it keeps the other ranks waiting, not failing; a peer
            silent past it ends that step not replicated on every rank and turns
            replication off for the rest of the job (one agreed decision).
    """

    path: str | os.PathLike[str]
    _: dataclasses.KW_ONLY
    retention: RetentionPolicy = _LOCAL_RETENTION
    promote_every: int = 1
    min_free_bytes: int = 0
    replicas: int = 1
    replica_jump: int = 1
    replication_timeout: float = 600.0

    def __post_init__(self) -> None:
        t = self.replication_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or t <= 0:
            raise ConfigurationError(
                f"LocalTier option replication_timeout={t!r} is invalid: expected seconds > 0"
            )
        if not isinstance(self.retention, RetentionPolicy):
            raise ConfigurationError(
                f"LocalTier option retention={self.retention!r} is invalid: expected "
                "objckpt.RetentionPolicy(keep_last=...)"
            )
        _positive_int("promote_every", self.promote_every, allow_none=False)
        _positive_int("replicas", self.replicas, allow_none=False)
        _positive_int("replica_jump", self.replica_jump, allow_none=False)
        m = self.min_free_bytes
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ConfigurationError(
                f"LocalTier option min_free_bytes={m!r} is invalid: expected an int >= 0"
            )
        loc = Location.parse(self.path)
        if not loc.is_local:
            raise ConfigurationError(
                f"LocalTier path {loc.url} is not a local directory; a second object "
                "store is a backup (CheckpointManager(backups=[...]))"
            )

    @property
    def location(self) -> Location:
        return Location.parse(self.path)


@dataclasses.dataclass(frozen=True)
class TierStatus:
    """How far the durable tier trails the local one (this rank's view).

    Attributes:
        local_latest: Newest step committed on the local tier (None: none).
        durable_latest: Newest step committed on the primary root (None: none).
        steps_behind: Local steps picked for promotion and newer than
            ``durable_latest`` (0: everything promoted is durable).
        seconds_behind: Age of the oldest of those, in seconds.
        promoting: Steps whose promotion is running.
        last_time_to_durable: Seconds from ``save`` to durable for the newest
            promoted step (None: none yet).
        degraded: Why saves currently bypass the local tier (None: they do not).
        error: The last promotion failure, if any.
        replicas: How many nodes hold each node's files of a local step (1: no
            replicas: ``LocalTier(replicas=1)``, one node, or replication off).
        replicated_latest: Newest local step every node's files of which are held
            by ``replicas`` nodes (None: none).
        not_replicated: Local steps kept whose replication failed (they are
            committed on the local tier; a node lost now loses them).
        last_time_to_replicated: Seconds from ``save`` to replicated for the
            newest replicated step (None: none yet).
        replication_error: The last replication failure, naming the node.
    """

    path: str
    local_latest: int | None
    durable_latest: int | None
    steps_behind: int
    seconds_behind: float
    promoting: tuple[int, ...]
    last_time_to_durable: float | None
    degraded: str | None = None
    error: str | None = None
    replicas: int = 1
    replicated_latest: int | None = None
    not_replicated: tuple[int, ...] = ()
    last_time_to_replicated: float | None = None
    replication_error: str | None = None


def state_bytes(state_dict: Mapping[str, Any]) -> int:
    """Bytes of the tensors in a (nested) state dict this rank holds (its local
    shards for DTensors): what a local save of it writes, give or take the
    serialization overhead."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state_dict)
    return total


def local_room(tier: LocalTier, need: int) -> str | None:
    """None when this process can write to the local tier and ``need`` bytes (plus
    5 % and the tier's headroom) fit there, else why not (a sentence for the log)."""
    root = tier.location.path
    try:
        free = NodeStore(root).probe()
    except OSError as exc:
        return f"local tier {root} is not writable ({exc.strerror or exc})"
    wanted = need + need // 20 + tier.min_free_bytes
    if wanted > free:
        return (
            f"local tier {root} has {free} bytes free, the save needs about {wanted} "
            f"({need} of state + 5% + min_free_bytes={tier.min_free_bytes})"
        )
    return None


def is_disk_full(exc: BaseException) -> bool:
    """Whether a save failed because a disk filled up (ENOSPC, EFBIG, EDQUOT), as
    far as its error says: errors from upload workers arrive pickled, without
    their errno, so the text is read too."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if any(t in str(e) for t in _FULL_TEXT):
            return True
    return False


def is_not_writable(exc: BaseException) -> bool:
    """Whether a local save failed because the tier refuses writes (EACCES, EPERM,
    EROFS), read from its errno or, for errors pickled by upload workers, its text."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in _REFUSED:
            return True
        if isinstance(e, PermissionError) or any(t in str(e) for t in _REFUSED_TEXT):
            return True
    return False
