"""Stock DCP readers on a step that references another step's bytes (#28 item 2).

``.metadata`` names a reused item by its reference key (``../step-N/<key>``).
torch's ``FileSystemReader`` joins it to the step's path with pathlib and the OS
resolves ``..``; ``FsspecReader`` joins strings, which a local filesystem resolves
too, but an object store takes literally: there the stock reader cannot load a
referencing step (docs/format.md and docs/guides/reuse.md say so).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state
from helpers import quiet, save
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from objckpt import Location
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget


def _two_steps(target: StoreTarget) -> tuple[dict, str]:
    """Step 1, then step 2 of a state whose ``frozen`` tensor did not change."""
    state = {"frozen": torch.randn(256, 64), "trained": torch.zeros(8, 8), "meta": {"n": 1}}
    one = target.url(f"run/{step_name(1)}")
    save(state, one, target)
    state["trained"] += 1
    state["meta"]["n"] = 2
    save(state, target.url(f"run/{step_name(2)}"), target, reuse_from=one)
    return state, target.url(f"run/{step_name(2)}")


def test_stock_readers_load_a_referencing_step_on_a_local_filesystem(tmp_path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    state, url = _two_steps(target)
    path = Location.parse(url).path
    for reader in (dcp.FileSystemReader(path), FsspecReader(path), FsspecReader(url)):
        got = empty_like_state(state)
        with quiet():
            dcp.load(got, storage_reader=reader)
        assert_state_equal(got, state)


def test_the_stock_fsspec_reader_cannot_follow_a_reference_on_an_object_store(
    s3_bucket: StoreTarget,
) -> None:
    state, url = _two_steps(s3_bucket)
    with quiet(), pytest.raises(BaseException, match=r"step-0000000002/\.\./step-0000000001"):
        dcp.load(
            empty_like_state(state),
            storage_reader=FsspecReader(url, **s3_bucket.storage_options),
        )
