"""The fault matrix: a fault on exactly one of four gloo ranks is every rank's outcome.

For each column (sync saves through ``dcp.save``, async saves through
``AsyncCheckpointer``, loads through ``dcp.load``) one job of four real gloo
processes walks every cell against a moto server behind the recording proxy. Per
cell, the test checks: every rank reported (none hung), every rank ended the same
way (all raised, or all succeeded where the fault must not fail the save), within
the save deadline + 30 s; the operation after it succeeds on every rank; and the
committed ``base`` step is byte-identical before and after the whole column.

``test_fault_matrix_summary`` prints the table the docs show (failure semantics).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import fault_ranks
import pytest
import torch.distributed.checkpoint as dcp
from ranks import run_ranks

from objckpt import ObjectStoreWriter
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget

logger = logging.getLogger(__name__)

WORLD = 4
BOUND = fault_ranks.DEADLINE + 3 * fault_ranks.BARRIER + 30


def _proxy_rules(proxy: FaultProxy, root: str) -> None:
    """Store faults, each keyed to its own cell so it breaks nothing else."""
    prefix = root.split("://", 1)[1].split("/", 1)[1]
    for rule in (
        # Rank 2's payload objects: every write refused, for good.
        Rule(key_contains=f"{prefix}/upload-fails/__2_", operation="PutObject", status=500),
        Rule(key_contains=f"{prefix}/upload-fails/__2_", operation="UploadPart", status=500),
        Rule(
            key_contains=f"{prefix}/upload-fails/__2_",
            operation="CreateMultipartUpload",
            status=500,
        ),
        # Rank 2's payload writes held past rank 0's barrier_timeout, then forwarded.
        *(
            Rule(
                key_contains=f"{prefix}/upload-late/__2_",
                operation=op,
                action="stall",
                stall=fault_ranks.LATE,
            )
            for op in ("PutObject", "UploadPart", "CreateMultipartUpload")
        ),
        Rule(key_contains=f"{prefix}/index-put-fails/__index_", operation="PutObject", status=500),
        Rule(
            key_contains=f"{prefix}/commit-fails/manifest.json", operation="PutObject", status=500
        ),
        Rule(key_contains=f"{prefix}/payload-get-fails/__3_", operation="GetObject", status=500),
        Rule(
            key_contains=f"{prefix}/load-falls-back/step-0000000001/__3_",
            operation="GetObject",
            status=500,
        ),
    ):
        proxy.add(rule)


def _opts(target: StoreTarget) -> dict[str, Any]:
    return {"storage_options": target.storage_options}


def _committed_bytes(target: StoreTarget, url: str) -> dict[str, bytes]:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **target.storage_options)
    path = url.split("://", 1)[1]
    return {p: fs.cat_file(p) for p in sorted(fs.find(path))}


def _run_column(
    body: Any,
    cells: list[tuple[str, int]],
    tmp_path: Path,
    target: StoreTarget,
    proxy: FaultProxy,
    name: str,
) -> dict[str, list[dict[str, Any]]]:
    root = target.url(name)
    _proxy_rules(proxy, root)
    out = tmp_path / f"out-{name}"
    out.mkdir()
    args = (
        body.__name__,
        WORLD,
        str(tmp_path / f"init-{name}"),
        root,
        proxy.storage_options(),
        str(out),
    )
    run_ranks(fault_ranks, *args)
    found: dict[str, list[dict[str, Any]]] = {}
    for cell, _ in cells:
        for key in (cell, f"{cell}.after"):
            found[key] = [
                json.loads(p.read_text())
                for r in range(WORLD)
                if (p := out / f"{key}.rank{r}.json").exists()
            ]
    return found


def _check(found: dict[str, list[dict[str, Any]]], cells: list[tuple[str, int]]) -> list[str]:
    problems = []
    for cell, faulty in cells:
        reports = found[cell]
        if len(reports) != WORLD:
            problems.append(f"{cell}: {WORLD - len(reports)} rank(s) hung")
            continue
        outcomes = {r["outcome"] for r in reports}
        expected = "ok" if cell in fault_ranks.SUCCEEDS else "error"
        if outcomes != {expected}:
            problems.append(f"{cell} (fault on rank {faulty}): outcomes {reports}")
        slow = [r["seconds"] for r in reports if r["seconds"] > BOUND]
        if slow:
            problems.append(f"{cell}: took {max(slow):.0f} s > {BOUND:.0f} s")
        after = found[f"{cell}.after"]
        if len(after) != WORLD or {r["outcome"] for r in after} != {"ok"}:
            problems.append(f"{cell}: the next operation did not succeed everywhere: {after}")
    return problems


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "column",
    [
        pytest.param((fault_ranks.async_column, fault_ranks.ASYNC_CELLS), id="async-save"),
        pytest.param((fault_ranks.sync_column, fault_ranks.SYNC_CELLS), id="sync-save"),
        pytest.param((fault_ranks.load_column, fault_ranks.LOAD_CELLS), id="load"),
        pytest.param((fault_ranks.manager_column, fault_ranks.MANAGER_CELLS), id="manager"),
        pytest.param(
            (fault_ranks.replication_column, fault_ranks.REPLICATION_CELLS), id="replication"
        ),
    ],
)
def test_a_fault_on_one_rank_is_every_ranks_outcome(
    column: Any, s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    body, cells = column
    name = body.__name__
    base = s3_bucket.url(f"{name}/base")
    state = fault_ranks.everything(WORLD)
    dcp.save(state, storage_writer=ObjectStoreWriter(base, **_opts(s3_bucket)), no_dist=True)
    before = _committed_bytes(s3_bucket, base)
    found = _run_column(body, cells, tmp_path, s3_bucket, s3_proxy, name)
    problems = _check(found, cells)
    if _committed_bytes(s3_bucket, base) != before:
        problems.append("the committed base step changed")
    if "upload-late" in found and len(found["upload-late"]) == WORLD:
        # Rank 0 gave up waiting for rank 2, alive and still uploading: the path a
        # refusal took while it was retried for longer than barrier_timeout.
        said = found["upload-late"][0]["error"]
        if f"within {fault_ranks.BARRIER:g} s" not in said:
            problems.append(f"upload-late: rank 0 did not time out on rank 2's report: {said}")
    for cell, _ in cells:
        logger.info("%s %s: %s", name, cell, [(r["outcome"], r["type"]) for r in found[cell]])
    assert problems == []


def test_a_sparse_tensor_on_one_rank_fails_the_save_on_every_rank_and_the_next_commits(
    s3_bucket: StoreTarget, tmp_path: Path
) -> None:
    """Rank 1 raised in staging and went on alone: its step 2 paired with rank 0's step
    1 (rank 0 listed [1], rank 1 listed [2]) and rank 0's step 2 hung on gloo."""
    out = tmp_path / "out"
    out.mkdir()
    args = (
        "manager_sparse_on_one_rank",
        2,
        str(tmp_path / "init"),
        s3_bucket.url("sparse"),
        s3_bucket.storage_options,
        str(out),
    )
    run_ranks(fault_ranks, *args)
    step1 = [json.loads((out / f"step1.rank{r}.json").read_text()) for r in range(2)]
    assert [s["outcome"] for s in step1] == ["error", "error"], step1
    assert step1[1]["type"] == "StateDictError", step1
    assert "rank 1" in step1[0]["error"], step1  # rank 0 names the failing rank
    step2 = [json.loads((out / f"step2.rank{r}.json").read_text()) for r in range(2)]
    assert [s["outcome"] for s in step2] == ["ok", "ok"], step2
    steps = [json.loads((out / f"steps.rank{r}.json").read_text()) for r in range(2)]
    assert steps == [[2], [2]]


def test_objckpt_collectives_run_on_a_group_without_a_cpu_backend(tmp_path: Path) -> None:
    args = ("collectives_without_cpu_backend", 2, str(tmp_path / "init"))
    run_ranks(fault_ranks, *args)


def test_ranks_in_different_saves_fail_that_save_and_the_next_commits(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ("saves_out_of_step", 2, str(tmp_path / "init"), f"file://{tmp_path}/ck", str(out))
    run_ranks(fault_ranks, *args)
    skewed = [json.loads((out / f"skewed.rank{r}.json").read_text()) for r in range(2)]
    assert [s["type"] for s in skewed] == ["SaveSequenceError"] * 2, skewed
    assert "save 2" in skewed[0]["error"] and "save 3" in skewed[0]["error"], skewed
    after = [json.loads((out / f"next.rank{r}.json").read_text()) for r in range(2)]
    assert [s["outcome"] for s in after] == ["ok", "ok"], after
