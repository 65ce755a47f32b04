"""Reuse across a resharded restart (real gloo): saved on 4 ranks, loaded and saved
again on 2. Whatever is the same item with the same bytes is reused; what the new
world size cuts differently is uploaded; both steps load bit-exact."""

from __future__ import annotations

import reuse_ranks
import torch
from conftest import assert_state_equal
from helpers import load
from ranks import run_ranks
from reuse_helpers import stored_items

from objckpt.format.refs import is_reference
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget


def _run(body, world: int, tmp_path, url: str, options: dict) -> None:
    init_file = tmp_path / f"init-{body.__name__}-{world}"
    args = (body.__name__, world, str(init_file), url, options)
    run_ranks(reuse_ranks, *args)


def test_a_job_resharded_from_4_to_2_ranks_reuses_what_is_unchanged(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    root = s3_bucket.url("reshard")
    _run(reuse_ranks.save_step_1, 4, tmp_path, root, s3_bucket.storage_options)
    _run(reuse_ranks.load_and_save_step_2, 2, tmp_path, root, s3_bucket.storage_options)

    one = stored_items(f"{root}/{step_name(1)}", s3_bucket)
    two = stored_items(f"{root}/{step_name(2)}", s3_bucket)
    reused = {i.fqn for i, item in two.items() if is_reference(item.relative_path)}
    # The same items with the same bytes: referenced where step 1 stores them.
    assert reused == {"plain.norm", "plain.bias", "step"}, reused
    for index, item in two.items():
        if is_reference(item.relative_path):
            base = one[index]
            assert item.relative_path == f"../{step_name(1)}/{base.relative_path}"
            assert (item.offset, item.length, item.xxh3) == (base.offset, base.length, base.xxh3)
    # Shards cut at 2 ranks are other items (other chunk sizes): never reused.
    assert not any(fqn.startswith("sharded.") for fqn in reused)
    assert all(item.xxh3 for item in two.values())

    expected = reuse_ranks._replicated()
    state = {"plain": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(state, f"{root}/{step_name(2)}", s3_bucket)
    assert_state_equal(state, {"plain": expected, "step": 7})
