"""What a load from the nodes takes: rank 0's decision, a pure function of what is held.

Why pure: the decision is where a restore's guarantees live (a copy a rollback
discarded never loads, holders that disagree load nothing, a copy found bad is not
planned from again, a step no surviving node holds whole falls back to the newest
durable one). As a function of values (:class:`Survey`: the nodes' listings, the
manifests they posted, the root's rollback records, the newest durable step) it
reads, writes and logs nothing: every read it needs is made before it runs, by
:class:`~objckpt.ops.run.restore.Restorer`, which then runs the I/O the answer
(:class:`Plan`) names and logs its warnings. So it is tested on holdings written by
hand, with no store, process group or c10d store (``tests/ops/test_restore_plan.py``).

Which manifests are read first: each copy of each step the decision may judge
(:func:`copies_needed`): the step asked for, or every step the nodes hold above the
newest durable one. A tier keeps a few steps, so that is a few manifests from the
job's own c10d store, each read once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from objckpt.errors import CheckpointNotFoundError, InternalError, ManifestError, ObjckptError
from objckpt.format.layout import writer_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepPlaces
from objckpt.ops.run.rollback import Rollback
from objckpt.ops.tier.peers import Holdings, NodeMap
from objckpt.writers.location import Location

__all__ = ["BadCopy", "Decision", "Plan", "Survey", "copies_needed", "decide", "holders_of"]


@dataclasses.dataclass(frozen=True)
class BadCopy:
    """A copy of a step's objects a rank found unusable during a load.

    Attributes:
        step: The step.
        rank: The rank holding the copy (its node's ranks hold it alike).
        keys: The objects.
        why: What was wrong (a CRC32C mismatch, a failed read on the sender).
        path: The damaged file on the holder's node, when the finder is on it.
    """

    step: int
    rank: int
    keys: tuple[str, ...]
    why: str
    path: str | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """Rank 0's answer to "what does this load take?", the same on every rank.

    Attributes:
        step: The step to load.
        durable: The newest durable step (None: none).
        from_nodes: Whether its objects come from the nodes' tiers.
        refill: Whether its nodes' files go to their replica nodes again after the
            load (some object is on fewer nodes than the tier's replicas).
        stale: The copies of discarded steps every node deletes: (step, manifest
            SHA-256).
    """

    step: int
    durable: int | None
    from_nodes: bool
    refill: bool = False
    stale: tuple[tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Survey:
    """What rank 0 knows when it decides, every part read beforehand.

    Attributes:
        step: The step asked for (None: the newest one whole on the nodes, else the
            newest durable one).
        views: Each rank's holdings (the ranks of a node share one listing).
        held: Each rank's manifests by step, as SHA-256 digests.
        copies: The manifest bytes of the copies :func:`copies_needed` names, by
            (step, digest), or why that copy could not be read.
        durable: The newest durable step (None: none).
        rollbacks: The root's rollback records.
        failed: Steps whose load from the nodes failed earlier in this load.
        bad: The copies found bad since the last decision (gathered from every rank).
        excluded: (step, node, key) of the copies found bad earlier in this load.
        nodes: The job's node map.
        replicas: How many nodes should hold each object (the tier's, as the node
            map allows; 1 without a tier).
        root: The primary root (names the step in a manifest's errors).
    """

    step: int | None
    views: Sequence[Holdings]
    held: Sequence[Mapping[int, str]]
    copies: Mapping[tuple[int, str], bytes | ManifestError]
    durable: int | None
    rollbacks: Sequence[Rollback]
    failed: Collection[int]
    bad: Sequence[BadCopy]
    excluded: frozenset[tuple[int, int, str]]
    nodes: NodeMap
    replicas: int
    root: Location


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision and what rank 0 alone keeps of it (never broadcast).

    Attributes:
        decision: What every rank is told, or the error every rank raises (no step
            was asked for, none is whole on the nodes left and none is durable; or an
            internal error: a copy the decision needs was not handed to it).
        manifest: A load from the nodes: the chosen step's manifest bytes.
        views: A load from the nodes: the holdings its transfers are planned from.
        excluded: The copies found bad in this load so far (the next survey's).
        warnings: What the caller logs, in order.
    """

    decision: Decision | ObjckptError
    manifest: bytes | None = None
    views: Sequence[Holdings] | None = None
    excluded: frozenset[tuple[int, int, str]] = frozenset()
    warnings: tuple[str, ...] = ()


def _candidates(
    step: int | None,
    held: Sequence[Mapping[int, str]],
    durable: int | None,
    failed: Collection[int],
    bad: Sequence[BadCopy],
) -> list[int]:
    """The steps to judge, newest first: ``step``, or every step held above the newest
    durable one; a step whose load from the nodes failed, with no copy found bad since,
    would fail the same way again and is left out."""
    steps = {s for h in held for s in h}
    order = sorted(steps, reverse=True) if step is None else [step]
    out = []
    for s in order:
        if step is None and durable is not None and s <= durable:
            break
        if s in failed and not bad:
            continue
        out.append(s)
    return out


def copies_needed(
    step: int | None,
    held: Sequence[Mapping[int, str]],
    durable: int | None,
    failed: Collection[int],
    bad: Sequence[BadCopy],
) -> set[tuple[int, str]]:
    """The manifest copies, as (step, digest), that :func:`decide` may judge: the
    copies the nodes hold of each candidate step (read before it runs)."""
    steps = set(_candidates(step, held, durable, failed, bad))
    return {(s, d) for h in held for s, d in h.items() if s in steps}


def holders_of(step: int, views: Sequence[Holdings]) -> dict[tuple[str, int], list[int]]:
    """The ranks holding each (key, size) of ``step``: one pass over each distinct
    listing (the ranks of a node share their node's), so rank 0's planning costs what
    the listings hold, not objects x ranks."""
    sharing: dict[int, list[int]] = {}  # a node's ranks share one listing (one pass each)
    for r, v in enumerate(views):
        sharing.setdefault(id(v), []).append(r)
    where: dict[tuple[str, int], list[int]] = {}
    for ranks in sharing.values():
        for key, size in views[ranks[0]].objects.get(step, {}).items():
            where.setdefault((key, size), []).extend(ranks)
    for holders in where.values():
        holders.sort()
    return where


class _Decider:
    """One decision's working state: the warnings it collects and the stale copies it
    finds (a helper of :func:`decide`; it reads nothing)."""

    def __init__(self, survey: Survey) -> None:
        self.s = survey
        self.warnings: list[str] = []
        self.stale: list[tuple[int, str]] = []

    def node(self, rank: int) -> str:
        """A rank's node, as a warning names it."""
        nodes = self.s.nodes
        if rank >= len(nodes.node_of):
            return f"rank {rank}'s node"
        return f"node {nodes.names[nodes.node_of[rank]]} (rank {rank})"

    def excluded(self) -> frozenset[tuple[int, int, str]]:
        """The copies found bad in this load, with the new reports (each warned of)."""
        nodes, out = self.s.nodes, set(self.s.excluded)
        for b in self.s.bad:
            node = nodes.node_of[b.rank] if b.rank < len(nodes.node_of) else -1
            out.update((b.step, node, key) for key in b.keys)
            self.warnings.append(
                f"step {b.step}: the copy of {', '.join(b.keys)} on {self.node(b.rank)} is bad "
                f"({b.why}){f', and {b.path} is deleted' if b.path else ''}; it is not used again"
            )
        return frozenset(out)

    def without(self, excluded: frozenset[tuple[int, int, str]]) -> list[Holdings]:
        """The holdings less the copies found bad in this load (by node)."""
        views = list(self.s.views)
        if not excluded:
            return views
        node_of = self.s.nodes.node_of
        out = []
        done: dict[tuple[int, int], Holdings] = {}  # a node's ranks keep sharing one listing
        for r, v in enumerate(views):
            node = node_of[r] if r < len(node_of) else -1
            if (id(v), node) not in done:
                objects = {
                    s: {k: n for k, n in held.items() if (s, node, k) not in excluded}
                    for s, held in v.objects.items()
                }
                done[(id(v), node)] = dataclasses.replace(v, objects=objects)
            out.append(done[(id(v), node)])
        return out

    def agreed(
        self, step: int, views: list[Holdings]
    ) -> tuple[bytes, Manifest, list[Holdings]] | None:
        """The one manifest of ``step`` its holders agree on, once every copy a rollback
        record discards is set aside (added to the stale copies, warned of), with the
        holdings to plan from (the ranks holding a set-aside copy count as holding
        nothing of ``step``); None when no copy is left, one is unusable, or the copies
        left disagree."""
        holders: dict[str, list[int]] = {}
        for r, h in enumerate(self.s.held):
            if step in h:
                holders.setdefault(h[step], []).append(r)
        kept: dict[str, tuple[bytes, Manifest, list[int]]] = {}
        for digest, ranks in holders.items():
            try:
                data = self.s.copies[(step, digest)]  # decide() checked that it was read
                if isinstance(data, ManifestError):
                    raise data
                manifest = Manifest.from_json_bytes(
                    data, url=StepPlaces.of(step, self.s.root).root.url
                )
            except ManifestError as exc:  # set aside: the other holders may still agree
                self.warnings.append(
                    f"step {step}: the manifest {', '.join(self.node(r) for r in ranks)} "
                    f"holds is unusable ({exc}); it is not used"
                )
                continue
            rolled = next(
                (rb for rb in self.s.rollbacks if rb.discards(step, data, manifest)), None
            )
            if rolled is None:
                kept[digest] = (data, manifest, ranks)
                continue
            named = rolled.names(step, data, manifest)
            if named:  # recorded by attempt or digest: safe to delete
                self.stale.append((step, digest))
            self.warnings.append(
                f"step {step} (attempt {manifest.attempt}, committed {manifest.created}) on "
                f"{', '.join(self.node(r) for r in ranks)} was discarded by "
                f"discard_after({rolled.after}) at {rolled.at}: it is not loaded"
                + (
                    ", and is deleted there"
                    if named
                    else " (committed before the rollback by the clocks; kept on disk, "
                    "since two hosts' clocks decide it)"
                )
            )
        if len(kept) != 1:
            if len(kept) > 1:
                self.warnings.append(
                    f"step {step}: the nodes hold different manifests of it ("
                    + "; ".join(
                        f"attempt {m.attempt} on {', '.join(self.node(r) for r in ranks)}"
                        for _, m, ranks in kept.values()
                    )
                    + ") and no rollback record tells which is current; it is not loaded"
                )
            return None
        data, manifest, _ = next(iter(kept.values()))
        other = {r for d, ranks in holders.items() if d not in kept for r in ranks}
        empty: dict[int, Holdings] = {}  # a node's ranks keep sharing one listing
        holding = [
            v
            if r not in other
            else empty.setdefault(id(v), dataclasses.replace(v, objects={}, manifests={}))
            for r, v in enumerate(views)
        ]
        return data, manifest, holding

    def thin(
        self, manifest: Manifest, views: list[Holdings], where: dict[tuple[str, int], list[int]]
    ) -> bool:
        """Whether some object of the step is held by fewer nodes than the tier's
        replicas (a node was replaced), when the same ranks can send it again
        (``where``: the ranks holding each (key, size), :func:`holders_of`)."""
        nodes = self.s.nodes
        if manifest.world_size != len(views) or nodes.problem is not None:
            return False
        for o in manifest.objects:
            if len({nodes.node_of[r] for r in where.get((o.key, o.size), ())}) < self.s.replicas:
                return True
        return False


def decide(survey: Survey) -> Plan:
    """What the load takes (its nodes' files are replicated again after the load when
    some object is on fewer nodes than the tier's replicas and the job runs on as many
    ranks as saved it), and, for a load from the nodes, the chosen step's manifest and
    the holdings to plan from. Reads, writes, logs and raises nothing.
    """
    s = survey
    unread = copies_needed(s.step, s.held, s.durable, s.failed, s.bad) - set(s.copies)
    if unread:  # the caller's bug: never a silent fallback to an older step
        return Plan(
            InternalError(
                "internal: the restore's decision was not handed the manifest copies "
                + ", ".join(f"step {st} {digest}" for st, digest in sorted(unread))
            )
        )
    d = _Decider(survey)
    warned: set[int] = set()  # once per listing: a node's ranks share one
    for r, v in enumerate(s.views):
        if v.error is not None and id(v) not in warned:
            warned.add(id(v))
            d.warnings.append(f"rank {r} cannot list its local tier {v.path}: {v.error}")
    excluded = d.excluded()
    views = d.without(excluded)
    for step in _candidates(s.step, s.held, s.durable, s.failed, s.bad):
        agreed = d.agreed(step, views)
        if agreed is None:
            continue
        data, manifest, holding = agreed
        where = holders_of(step, holding)  # one pass over the listings, not one per object
        lost = [o for o in manifest.objects if not where.get((o.key, o.size))]
        if not lost:
            thin = d.thin(manifest, holding, where)
            decision = Decision(step, s.durable, True, thin, tuple(d.stale))
            return Plan(decision, data, holding, excluded, tuple(d.warnings))
        ranks = sorted({r for r in (writer_rank(o.key) for o in lost) if r is not None})
        d.warnings.append(
            f"step {step} is committed on the local tier but no surviving node holds all "
            f"of it: {len(lost)} object(s) of rank(s) {', '.join(map(str, ranks)) or '?'} "
            "are on no node (their node and every node holding their replicas are gone)"
            + ("" if s.durable is None else f"; loading step {s.durable}, the newest durable one")
        )
    chosen: Decision | ObjckptError
    if s.step is not None:
        chosen = Decision(s.step, s.durable, False, stale=tuple(d.stale))
    elif s.durable is not None:
        chosen = Decision(s.durable, s.durable, False, stale=tuple(d.stale))
    else:
        chosen = CheckpointNotFoundError(
            f"no committed step under {s.root.url} nor whole on the local "
            "tiers of the nodes that are left"
        )
    return Plan(chosen, excluded=excluded, warnings=tuple(d.warnings))
