"""``ObjectStoreReader``'s default ``broadcast`` in a process group: rank 0 reads the
manifest at ``dcp.load``'s first step and the other ranks receive it (one GET per job,
not one per rank: the manifest grows with W, so W GETs of it are W^2 bytes per job).

Real gloo processes against moto. Which ranks GET the manifest on the wire at 4 and 16
ranks is tests/distributed/test_scale_ranks.py's; here: where each rank's manifest came from,
a second load on the same reader (read again), the opt-out, a not-committed checkpoint
failing every rank alike, a rank loading alone with ``broadcast=False``, every rank
loading a checkpoint of its own at once, and a load on a subgroup.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reader_ranks
from ranks import run_ranks

import objckpt
from objckpt.testing.plugin import StoreTarget


@pytest.mark.timeout(300)
def test_default_broadcast_in_a_process_group(s3_bucket: StoreTarget, tmp_path: Path) -> None:
    root = s3_bucket.url("reader-broadcast")
    args = ("loads", 2, str(tmp_path / "init"), root, s3_bucket.storage_options, str(tmp_path))
    run_ranks(reader_ranks, *args)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    manifest_url = f"{root}/ckpt/manifest.json"
    # Not read when built: the read is the collective at dcp.load's first step.
    assert r0["built_before_load"] is False and r1["built_before_load"] is False
    for key in ("default", "again"):
        assert r0[key]["equal"] and r1[key]["equal"], key
        assert r0[key]["source"] == manifest_url, (key, r0)
        assert r1[key]["source"] is None, (key, r1)  # received, not read
        assert r0[key]["metadata_bytes"] > 0, (key, r0)
    # Rank 1 fetched only index objects, never the manifest: fewer bytes than rank 0.
    assert r1["default"]["metadata_bytes"] < r0["default"]["metadata_bytes"]
    # Opting out: each rank reads it.
    assert r0["each"]["source"] == r1["each"]["source"] == manifest_url
    assert r0["each"]["equal"] and r1["each"]["equal"]
    # Not committed: every rank fails with the one error rank 0 found.
    for rec in (r0, r1):
        assert objckpt.errors.CheckpointNotCommittedError.__name__ in rec["bare"], rec["bare"]
        assert "bare" in rec["bare"]
    # Alone, inside the group, with broadcast=False: loaded, nothing waited.
    assert r0["alone"]["equal"] and r0["alone"]["source"] == manifest_url
    # Each rank its own checkpoint at once: each loaded its own bytes, read by itself
    # (rank 1's URL is not rank 0's, so it did not take rank 0's manifest).
    for r, rec in ((0, r0), (1, r1)):
        assert rec["own"]["equal"], rec
        assert rec["own"]["source"] == f"{root}/own-{r}/manifest.json", rec
    # A load on a subgroup, the reader given that subgroup: its rank 0 (global rank 1) reads.
    assert r1["subgroup"]["equal"] and r1["subgroup"]["source"] == manifest_url
