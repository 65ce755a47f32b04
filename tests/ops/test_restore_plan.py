"""The restore's decision as a pure function (#45 item 6): what a load from the nodes
takes, decided from holdings written by hand, with no store, process group or c10d
store, and without logging (its warnings come back as values)."""

from __future__ import annotations

import dataclasses
import hashlib

from objckpt import Location
from objckpt.errors import CheckpointNotFoundError, InternalError, ManifestError
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.ops.run.restore_plan import BadCopy, Decision, Survey, copies_needed, decide
from objckpt.ops.run.rollback import Rollback, manifest_digest
from objckpt.ops.tier.peers import Holdings, NodeMap

# Two nodes of two ranks each; node "a" holds ranks 0 and 1, node "b" ranks 2 and 3.
NODES = NodeMap(
    names=("a", "b"), node_of=(0, 0, 1, 1), local_of=(0, 1, 0, 1), lister_of=(0, 0, 2, 2)
)
ROOT = Location.parse("s3://bucket/run")


def _keys(attempt: str) -> list[str]:
    """Each rank's payload object of ``attempt`` (named by a label; keys take 16 hex)."""
    hex_id = hashlib.sha256(attempt.encode()).hexdigest()[:16]
    return [f"__{r}_0.{hex_id}.distcp" for r in range(4)]


def _manifest(attempt: str, created: str = "2026-12-05T10:00:00Z") -> bytes:
    return Manifest(
        attempt=attempt,
        created=created,
        world_size=4,
        objckpt_version="0.1.0",
        torch_version="2.13.0",
        objects=tuple(ObjectEntry(k, 10, "0000abcd") for k in _keys(attempt)),
        metadata={"state_dict": {}, "storage": []},
    ).to_json_bytes()


def _node(step_copies: dict[int, tuple[bytes, list[str]]]) -> tuple[Holdings, dict[int, str]]:
    """One node's listing: for each step, its manifest and the keys the node holds."""
    objects = {s: {k: 10 for k in keys} for s, (_, keys) in step_copies.items()}
    return Holdings("/tier", objects=objects), {
        s: manifest_digest(data) for s, (data, _) in step_copies.items()
    }


def _survey(
    a: dict[int, tuple[bytes, list[str]]],
    b: dict[int, tuple[bytes, list[str]]],
    *,
    step: int | None = None,
    durable: int | None = 3,
    rollbacks: tuple[Rollback, ...] = (),
    bad: tuple[BadCopy, ...] = (),
    failed: frozenset[int] = frozenset(),
) -> Survey:
    """A survey of nodes a and b (each listing shared by its two ranks), with every
    copy the decision may judge read, as the Restorer reads them first."""
    (va, ha), (vb, hb) = _node(a), _node(b)
    views, held = [va, va, vb, vb], [ha, ha, hb, hb]
    data = {(s, manifest_digest(d)): d for node in (a, b) for s, (d, _) in node.items()}
    needed = copies_needed(step, held, durable, failed, list(bad))
    return Survey(
        step=step,
        views=views,
        held=held,
        copies={k: data[k] for k in needed},
        durable=durable,
        rollbacks=rollbacks,
        failed=failed,
        bad=bad,
        excluded=frozenset(),
        nodes=NODES,
        replicas=2,
        root=ROOT,
    )


def test_a_step_both_nodes_hold_whole_is_loaded_from_them() -> None:
    """Each node holds its own ranks' files and the other's (replicas 2): step 5 loads
    from the nodes, nothing to refill; the transfers are planned from every listing."""
    m5 = _manifest("a5")
    every = _keys("a5")
    survey = _survey({5: (m5, every)}, {5: (m5, every)})
    plan = decide(survey)
    assert plan.decision == Decision(5, 3, True, refill=False)
    assert plan.manifest == m5 and plan.warnings == ()
    assert plan.views is not None and list(plan.views) == list(survey.views)


def test_an_object_on_one_node_only_is_loaded_and_refilled() -> None:
    """Node b lost its replica of rank 0's file: still whole, but on fewer nodes than
    the tier's replicas, so the load refills it."""
    m5 = _manifest("a5")
    keys = _keys("a5")
    plan = decide(_survey({5: (m5, keys)}, {5: (m5, keys[1:])}))
    assert plan.decision == Decision(5, 3, True, refill=True)


def test_an_object_no_node_holds_falls_back_to_the_newest_durable_step() -> None:
    m5 = _manifest("a5")
    keys = _keys("a5")
    plan = decide(_survey({5: (m5, keys[:3])}, {5: (m5, keys[:3])}))
    assert plan.decision == Decision(3, 3, False)
    assert plan.manifest is None
    (warning,) = plan.warnings
    assert "step 5" in warning and "rank(s) 3" in warning and "loading step 3" in warning


def test_holders_that_disagree_load_nothing_of_that_step() -> None:
    """Two manifests of step 5 and no rollback record: step 5 is not loaded, and the
    load falls back to the newest durable step."""
    m5a, m5b = _manifest("a5"), _manifest("b5")
    plan = decide(_survey({5: (m5a, _keys("a5"))}, {5: (m5b, _keys("b5"))}))
    assert plan.decision == Decision(3, 3, False)
    (warning,) = plan.warnings
    assert "different manifests" in warning and "attempt a5" in warning and "attempt b5" in warning


def test_a_copy_a_rollback_record_names_is_stale_and_the_other_is_loaded() -> None:
    """Node b was away during discard_after(4): its old step 5 is named by the record,
    set aside (its ranks hold nothing of step 5) and listed stale, to be deleted."""
    old, new = _manifest("old5"), _manifest("new5", created="2026-12-05T11:00:00Z")
    record = Rollback(4, "2026-12-05T10:30:00Z", {5: frozenset({("old5", manifest_digest(old))})})
    keys = _keys("new5")
    plan = decide(_survey({5: (new, keys)}, {5: (old, _keys("old5"))}, rollbacks=(record,)))
    assert plan.decision == Decision(5, 3, True, refill=True, stale=((5, manifest_digest(old)),))
    assert plan.views is not None and plan.views[2].objects == {}
    assert any("discarded by discard_after(4)" in w for w in plan.warnings)


def test_a_copy_found_bad_is_excluded_and_reported() -> None:
    """Rank 2 (node b) found its copy of rank 0's file bad: node a still holds it, so
    step 5 loads from the nodes without that copy, and the exclusion is kept."""
    m5 = _manifest("a5")
    keys = _keys("a5")
    bad = BadCopy(5, 2, (keys[0],), "CRC32C mismatch")
    plan = decide(_survey({5: (m5, keys)}, {5: (m5, keys)}, bad=(bad,), failed=frozenset({5})))
    assert plan.decision == Decision(5, 3, True, refill=True)
    assert plan.excluded == {(5, 1, keys[0])}
    assert plan.views is not None and keys[0] not in plan.views[2].objects[5]
    assert any("is bad (CRC32C mismatch)" in w for w in plan.warnings)


def test_a_failed_step_with_nothing_found_bad_is_not_tried_again() -> None:
    m5 = _manifest("a5")
    survey = _survey({5: (m5, _keys("a5"))}, {5: (m5, _keys("a5"))}, failed=frozenset({5}))
    assert survey.copies == {}  # not even read
    assert decide(survey).decision == Decision(3, 3, False)


def test_the_only_copy_unreadable_falls_back_to_the_newest_durable_step() -> None:
    m5 = _manifest("a5")
    keys = _keys("a5")
    survey = _survey({5: (m5, keys)}, {5: (m5, keys)})
    digest = manifest_digest(m5)
    unreadable = dataclasses.replace(
        survey, copies={(5, digest): ManifestError("no rank could post it")}
    )
    plan = decide(unreadable)
    assert plan.decision == Decision(3, 3, False)
    assert any("unusable (no rank could post it)" in w for w in plan.warnings)


def test_an_unreadable_copy_is_set_aside_and_the_other_holders_copy_is_loaded() -> None:
    """Node a's copy of step 5 cannot be read, node b's (another attempt) can and b holds
    all of it: step 5 loads from node b, node a's ranks count as holding nothing."""
    m5a, m5b = _manifest("a5"), _manifest("b5")
    survey = _survey({5: (m5a, _keys("a5"))}, {5: (m5b, _keys("b5"))})
    copies = dict(survey.copies)
    copies[(5, manifest_digest(m5a))] = ManifestError("cut short")
    plan = decide(dataclasses.replace(survey, copies=copies))
    assert plan.decision == Decision(5, 3, True, refill=True)
    assert plan.manifest == m5b
    assert plan.views is not None
    assert [dict(v.objects) for v in plan.views[:2]] == [{}, {}]
    assert set(plan.views[2].objects[5]) == set(_keys("b5"))


def test_a_copy_committed_before_a_rollback_and_not_named_is_not_loaded_nor_deleted() -> None:
    """Both nodes hold step 5 committed before discard_after(4) by the clocks, and the
    record names no copy of it: not loaded (two clocks decide it), not stale either."""
    m5 = _manifest("a5", created="2026-12-05T10:00:00Z")
    record = Rollback(4, "2026-12-05T10:30:00Z", {})
    plan = decide(_survey({5: (m5, _keys("a5"))}, {5: (m5, _keys("a5"))}, rollbacks=(record,)))
    assert plan.decision == Decision(3, 3, False, stale=())
    assert any("kept on disk" in w for w in plan.warnings)


def test_a_newer_step_that_cannot_load_falls_back_to_the_next_one_held_whole() -> None:
    """Step 6's holders disagree; step 5 is whole on both nodes: step 5 loads from them."""
    m6a, m6b, m5 = _manifest("a6"), _manifest("b6"), _manifest("a5")
    a = {6: (m6a, _keys("a6")), 5: (m5, _keys("a5"))}
    b = {6: (m6b, _keys("b6")), 5: (m5, _keys("a5"))}
    plan = decide(_survey(a, b))
    assert plan.decision == Decision(5, 3, True, refill=False)
    assert plan.manifest == m5


def test_a_step_asked_for_that_is_not_whole_is_loaded_from_the_store() -> None:
    m5 = _manifest("a5")
    plan = decide(_survey({5: (m5, _keys("a5")[:2])}, {}, step=5))
    assert plan.decision == Decision(5, 3, False)
    assert any("rank(s) 2, 3" in w for w in plan.warnings)


def test_copies_found_bad_in_an_earlier_survey_stay_excluded() -> None:
    """Node a's copy of rank 3's file was found bad in this load's first survey, and
    node b lost its: no node holds it now, so the step is not loaded from the nodes."""
    m5 = _manifest("a5")
    keys = _keys("a5")
    survey = _survey({5: (m5, keys)}, {5: (m5, keys[:3])})
    plan = decide(dataclasses.replace(survey, excluded=frozenset({(5, 0, keys[3])})))
    assert plan.decision == Decision(3, 3, False)
    assert plan.excluded == {(5, 0, keys[3])}


def test_a_job_on_another_world_size_refills_nothing() -> None:
    """The step was saved by 2 ranks, the job runs on 4: an object on one node only is
    loaded, but not replicated again (the ranks that would send it are not the same)."""
    m5 = Manifest.from_json_bytes(_manifest("a5"), url="u")
    two = dataclasses.replace(m5, world_size=2).to_json_bytes()
    keys = _keys("a5")
    plan = decide(_survey({5: (two, keys)}, {5: (two, keys[1:])}))
    assert plan.decision == Decision(5, 3, True, refill=False)


def test_a_survey_missing_a_copy_it_needs_is_an_internal_error() -> None:
    """copies_needed and decide never drift apart silently: a copy the decision needs
    and was not handed is a bug in the caller, raised on every rank."""
    m5 = _manifest("a5")
    survey = _survey({5: (m5, _keys("a5"))}, {5: (m5, _keys("a5"))})
    plan = decide(dataclasses.replace(survey, copies={}))
    assert isinstance(plan.decision, InternalError)
    assert "step 5" in str(plan.decision)


def test_a_step_that_is_no_step_raises_nothing_in_the_decision() -> None:
    """An invalid step asked for, held by no node: the decision says to load it from
    the store (which refuses it there), instead of raising inside the decision."""
    plan = decide(_survey({}, {}, step=-1))
    assert plan.decision == Decision(-1, 3, False)


def test_nothing_whole_and_nothing_durable_is_an_error_every_rank_raises() -> None:
    m5 = _manifest("a5")
    plan = decide(_survey({5: (m5, _keys("a5")[:1])}, {}, durable=None))
    assert isinstance(plan.decision, CheckpointNotFoundError)
    assert "s3://bucket/run" in str(plan.decision)


def test_only_the_copies_of_candidate_steps_are_read() -> None:
    """Steps at or below the newest durable one are never judged, so never read; a
    step asked for is read whatever the durable one."""
    m2, m5 = _manifest("a2"), _manifest("a5")
    survey = _survey({2: (m2, _keys("a2")), 5: (m5, _keys("a5"))}, {5: (m5, _keys("a5"))})
    assert set(survey.copies) == {(5, manifest_digest(m5))}
    asked = _survey({2: (m2, _keys("a2")), 5: (m5, _keys("a5"))}, {}, step=2)
    assert set(asked.copies) == {(2, manifest_digest(m2))}
    # Node a holds all of step 2, on one node of the two the tier wants: refilled.
    assert decide(asked).decision == Decision(2, 3, True, refill=True)
