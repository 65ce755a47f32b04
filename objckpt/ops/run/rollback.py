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

With a local tier, a discarded step can come back from a node: one that was away
during the discard (its disk intact) still holds its copy, and a restart would load
it. So the discard leaves a **rollback record** on the root before it deletes
anything, ``<root>/rollbacks/<time>-<id>.json`` (outside every step directory, so
listings, retention and gc never take it for a step): the step rolled back to, the
time (UTC, seconds), and the attempt id and SHA-256 of every manifest of a step above
it that some node held then. A restart (:mod:`objckpt.ops.run.restore`) never loads a
node's copy of a step above a record's step whose manifest the record names, or
that was committed before the record's time. And every rank's local deletion is
agreed: a rank whose listing or deletion failed (a replica manifest may survive
there) makes the call raise on every rank, naming that rank and the path; calling
again finishes the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence

from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.errors import ManifestError, SaveDeadlineError, StoreError
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES
from objckpt.format.manifest import Manifest
from objckpt.format.steps import step_name
from objckpt.ops.run.catalog import StepCatalog
from objckpt.ops.run.durable import DurableSteps
from objckpt.ops.run.saving import SaveFlow
from objckpt.ops.tier.local_disk import Verdict, delete_local_step, list_tier
from objckpt.ops.tier.peers import list_holdings, replica_dir
from objckpt.ops.tier.tiers import LocalTier
from objckpt.pipeline.lifetime import run_bounded
from objckpt.writers import open_store
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = ["ROLLBACKS_DIR", "Rollback", "discard_after", "judge_copy", "read_rollbacks"]

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
    collectives: Collectives,
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
    collectives.fail_together(failure, f"discarding the steps above {step}")
    catalog.reload()
    doomed = catalog.above(step)
    held: dict[int, set[bytes]] = {}
    if local is not None:
        # Every node's manifests above the step, for the record (a collective).
        mine = list_holdings(local.location.path)
        unlisted = None
        if mine.error is not None:
            unlisted = StoreError(
                f"rank {collectives.rank} cannot list its local tier {mine.path} to "
                f"discard the steps above {step}: {mine.error}; nothing was discarded "
                "(call discard_after again)"
            )
        collectives.fail_together(unlisted, f"listing the local tiers above step {step}")
        above = {s: m for s, m in mine.manifests.items() if s > step}
        views = collectives.gather_object(above) if is_distributed() else [above]
        for view in views or ():
            for s, data in view.items():
                held.setdefault(s, set()).add(data)

    def discard_durable() -> list[int]:
        if local is not None:
            _record(catalog.root, step, held)
        return durable.discard_after(step, timeout=SETTLE_TIMEOUT)

    collectives.from_rank0(discard_durable)
    if local is not None:
        error = _discard_local(local, step, collectives.rank)
        collectives.fail_together(error, f"discarding the local steps above {step}")
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


def _discard_local(tier: LocalTier, step: int, rank: int) -> StoreError | None:
    """This rank's local directories of steps above ``step``, committed or not (never
    through a link; :mod:`objckpt.ops.tier.local_disk`).

    Returns:
        Why a step above ``step`` may still be committed on this node (its tier
        could not be listed, or a manifest above ``step`` is still there after the
        deletion), naming this rank and the path; None when none is.
    """
    root = tier.location.path
    listing = list_tier(root)
    if listing.error is not None:
        return StoreError(
            f"rank {rank} cannot list its local tier {root} to discard the steps above "
            f"{step}: {listing.error}; nothing there was discarded (call discard_after again)"
        )
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
    # A manifest still there keeps a discarded step committed on this node.
    after = list_tier(root)
    if after.error is not None:
        return StoreError(
            f"rank {rank} cannot list its local tier {root} after discarding the steps above "
            f"{step}: {after.error} (call discard_after again)"
        )
    left = [os.path.join(root, step_name(s)) for s in sorted(after.committed) if s > step] + [
        replica_dir(root, s) for s in sorted(after.replicas_committed) if s > step
    ]
    if left:
        return StoreError(
            f"rank {rank} could not delete the manifest of {', '.join(left)} (see the log): "
            f"those steps above {step} are still committed on its node; call "
            "discard_after again"
        )
    return None


# -- the rollback record ---------------------------------------------------------------
#: Where the root keeps its rollback records (outside every step directory).
ROLLBACKS_DIR = "rollbacks"


def manifest_digest(data: bytes) -> str:
    """The SHA-256 that names a copy of a manifest (rollback records, the restore's
    comparison of holders: one definition for both)."""
    return hashlib.sha256(data).hexdigest()


def _instant(text: str) -> datetime.datetime | None:
    try:
        t = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Rollback:
    """One ``discard_after`` as the root records it.

    Attributes:
        after: The step the run went back to.
        at: When (ISO 8601, UTC, seconds).
        discarded: Step -> the (attempt id, SHA-256) of each manifest of it that
            some node held at the discard.
    """

    after: int
    at: str
    discarded: Mapping[int, frozenset[tuple[str, str]]]

    def names(self, step: int, data: bytes, manifest: Manifest) -> bool:
        """Whether this record names a node's copy of ``step`` (manifest bytes
        ``data``): its attempt or digest is recorded (a copy it is safe to delete)."""
        if step <= self.after:
            return False
        digest = manifest_digest(data)
        return any(
            (a and a == manifest.attempt) or d == digest for a, d in self.discarded.get(step, ())
        )

    def discards(self, step: int, data: bytes, manifest: Manifest) -> bool:
        """Whether a node's copy of ``step`` (manifest bytes ``data``) was discarded:
        :meth:`names` it, or it was committed before the rollback (two wall clocks
        compared: such a copy is not loaded, but never deleted on that ground)."""
        if step <= self.after:
            return False
        if self.names(step, data, manifest):
            return True
        made, at = _instant(manifest.created), _instant(self.at)
        return made is not None and at is not None and made < at

    def to_json_bytes(self) -> bytes:
        steps = {
            str(s): [{"attempt": a, "sha256": d} for a, d in sorted(v)]
            for s, v in sorted(self.discarded.items())
        }
        return json.dumps({"after": self.after, "at": self.at, "discarded": steps}).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes, url: str) -> Rollback:
        """Raises: ManifestError: ``data`` is no rollback record (naming ``url``)."""
        try:
            doc = json.loads(data)
            after, at = doc["after"], doc["at"]
            if not isinstance(after, int) or not isinstance(at, str):
                raise TypeError("after or at")
            discarded = {
                int(s): frozenset((str(e["attempt"]), str(e["sha256"])) for e in entries)
                for s, entries in doc.get("discarded", {}).items()
            }
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"{url} is no rollback record: {exc}") from exc
        return cls(after, at, discarded)


def _record(root: Location, step: int, held: Mapping[int, set[bytes]]) -> None:
    """Rank 0: write the rollback record of ``discard_after(step)`` (create-only).

    Raises:
        StoreError: It could not be written (then nothing is discarded).
    """
    discarded: dict[int, frozenset[tuple[str, str]]] = {}
    for s, copies in held.items():
        entries = set()
        for data in copies:
            try:
                attempt = Manifest.from_json_bytes(data, url=root.url).attempt
            except ManifestError:
                attempt = ""
            entries.add((attempt, manifest_digest(data)))
        discarded[s] = frozenset(entries)
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = Rollback(step, at, discarded)
    stamp = at[:19].replace("-", "").replace(":", "")
    key = f"{stamp}-{uuid.uuid4().hex[:16]}.json"
    records = root.child(ROLLBACKS_DIR)  # flat keys: every store family makes the prefix
    store = open_store(records)
    try:
        store.create(key, record.to_json_bytes())  # a StoreError names the key
    finally:
        store.close()
    logger.info("recorded the rollback to step %d at %s", step, records.url_of(key))


def judge_copy(records: Sequence[Rollback], step: int, data: bytes, url: str) -> Verdict:
    """What ``records`` say of a node's copy of ``step`` whose manifest is ``data``
    (``url`` names it in messages): None, it may load; ``"stale"``, a record names it
    (deleted where found); ``"aside"``, committed before a rollback by the clocks
    (never loaded; moved out of the step's name, never deleted on that ground). A
    manifest that cannot be read is left to the restore, which refuses it. Logs what
    it sets aside."""
    try:
        manifest = Manifest.from_json_bytes(data, url=url)
    except ManifestError:
        return None
    rolled = next((rb for rb in records if rb.discards(step, data, manifest)), None)
    if rolled is None:
        return None
    named = rolled.names(step, data, manifest)
    logger.warning(
        "%s (step %d, attempt %s, committed %s) was discarded by discard_after(%d) at %s: "
        "it is not loaded%s",
        url,
        step,
        manifest.attempt,
        manifest.created,
        rolled.after,
        rolled.at,
        " (a rollback record names it)" if named else " (committed before it by the clocks)",
    )
    return "stale" if named else "aside"


def read_rollbacks(root: Location) -> list[Rollback]:
    """Every rollback record under ``root`` (one listing, one read each); a record
    that cannot be read is skipped with a warning.

    Raises:
        StoreError: The records cannot be listed.
    """
    records = root.child(ROLLBACKS_DIR)
    store = open_store(records)
    try:
        try:
            names = sorted(store.listing())
        except Exception as exc:
            raise translate(exc, url=records.url, action="listing") from exc
        out = []
        for key in names:
            if not key.endswith(".json") or key.startswith("."):
                continue
            try:
                data = store.read_bounded(key, DEFAULT_MAX_METADATA_BYTES)
                if len(data) > DEFAULT_MAX_METADATA_BYTES:
                    raise ManifestError(f"larger than {DEFAULT_MAX_METADATA_BYTES} bytes")
                out.append(Rollback.from_json_bytes(data, records.url_of(key)))
            except Exception as exc:
                logger.warning(
                    "rollback record %s is unreadable; skipped: %s", records.url_of(key), exc
                )
        return out
    finally:
        store.close()
