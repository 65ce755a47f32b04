"""Stock DCP readers load objckpt checkpoints; objckpt loads stock ones (read-only)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state, sample_state
from helpers import load, quiet, save
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from objckpt import Location
from objckpt.testing.plugin import StoreTarget


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path) -> StoreTarget:
    if request.param == "file":
        return StoreTarget(root=f"file://{tmp_path}", storage_options={})
    return request.getfixturevalue("s3_bucket")


def _fsspec_path(target: StoreTarget, name: str) -> str:
    loc = Location.parse(target.url(name))
    return loc.path if loc.is_local else target.url(name)


def test_stock_readers_load_objckpt(target: StoreTarget) -> None:
    state = sample_state(big=100_000)
    save(state, target.url("ours"), target)
    got = empty_like_state(state)
    with quiet():
        dcp.load(
            got, storage_reader=FsspecReader(_fsspec_path(target, "ours"), **target.storage_options)
        )
    assert_state_equal(got, state)
    if target.root.startswith("file://"):
        got = empty_like_state(state)
        with quiet():
            dcp.load(got, storage_reader=dcp.FileSystemReader(_fsspec_path(target, "ours")))
        assert_state_equal(got, state)


def test_objckpt_loads_stock_checkpoints_read_only(
    target: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    state = sample_state(big=100_000)
    with quiet():
        dcp.save(
            state,
            storage_writer=FsspecWriter(
                _fsspec_path(target, "stock"), sync_files=False, **target.storage_options
            ),
        )
    got = empty_like_state(state)
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        reader = load(got, target.url("stock"), target)
    assert reader.is_stock
    assert_state_equal(got, state)
    assert any("stock DCP checkpoint" in r.getMessage() for r in caplog.records)


def test_objckpt_refuses_to_write_over_a_stock_checkpoint(target: StoreTarget) -> None:
    from helpers import carried

    from objckpt.errors import CheckpointExistsError

    with quiet():
        dcp.save(
            {"w": torch.ones(3)},
            storage_writer=FsspecWriter(
                _fsspec_path(target, "stock"), sync_files=False, **target.storage_options
            ),
        )
    with pytest.raises(BaseException) as info:
        save({"w": torch.zeros(3)}, target.url("stock"), target)
    assert isinstance(carried(info.value), CheckpointExistsError)
