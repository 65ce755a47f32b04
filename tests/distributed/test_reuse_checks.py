"""Reuse checks once per job, not once per rank (#46): after a restart, a job of 8
real gloo ranks saves a step that references every item of the step it loaded. Each
object of that base step is asked about (a HEAD: present, same size and CRC32C?) at
most once by the whole job, by the rank whose items lie in it, and the base's
manifest is read once (by the load), so the requests grow with the objects, not with
the world size times the objects."""

from __future__ import annotations

import collections

import reuse_check_ranks
from ranks import run_ranks
from reuse_helpers import stored_items

from objckpt.format.refs import is_reference
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget

WORLD = 8


def test_a_restarted_job_checks_each_referenced_object_once_not_once_per_rank(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    root = s3_bucket.url("reuse-checks")
    options = s3_bucket.storage_options
    run_ranks(reuse_check_ranks, "save_step_1", WORLD, str(tmp_path / "init-1"), root, options)
    s3_proxy.clear()
    run_ranks(
        reuse_check_ranks,
        "restart_and_save_step_2",
        WORLD,
        str(tmp_path / "init-2"),
        root,
        s3_proxy.storage_options(),
    )
    two = stored_items(f"{root}/{step_name(2)}", s3_bucket)
    referenced = {
        item.relative_path.split("/", 2)[2]
        for item in two.values()
        if is_reference(item.relative_path)
    }
    assert referenced, "step 2 reused nothing: the count below would prove nothing"
    base = f"/{step_name(1)}/"
    heads = collections.Counter(
        p.rsplit("/", 1)[-1] for p in s3_proxy.paths("HeadObject") if base in p
    )
    payload_heads = {k: n for k, n in heads.items() if k.endswith(".distcp")}
    # Every referenced object asked about at most once by the whole job (the rank
    # whose items lie in it), none of them once per rank.
    assert set(payload_heads) <= referenced, (payload_heads, referenced)
    assert all(n == 1 for n in payload_heads.values()), payload_heads
    assert sum(heads.values()) <= len(referenced) + 2, heads  # + the manifest's HEADs
    # The base's manifest is read once, by the load (rank 0, then broadcast); the
    # save's reuse takes it from there instead of every rank reading it again (was
    # W + 1 GETs of one object: 9 here, 8,193 at 8,192 ranks).
    gets = collections.Counter(
        p.rsplit("/", 1)[-1] for p in s3_proxy.paths("GetObject") if base in p
    )
    assert gets["manifest.json"] == 1, gets
    # Each index object read by its rank for the load and for the reuse, not by all.
    assert all(n <= 2 for k, n in gets.items() if k.startswith("__index_")), gets
