"""Stock DCP readers load objckpt checkpoints; objckpt loads stock ones (read-only)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state, sample_state
from helpers import load, quiet, save
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import objckpt
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


def test_dcp_sees_the_callers_checkpoint_id_and_a_save_id_while_planning(tmp_path) -> None:
    """As with FileSystemWriter/Reader: the planner gets the caller's checkpoint id and
    a save id before anything is written; each load gets a load id of its own."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    seen: dict = {}

    class Spy(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):  # type: ignore[no-untyped-def]
            seen["meta"] = storage_meta
            super().set_up_planner(state_dict, storage_meta, is_coordinator)

    url = str(tmp_path / "c")  # a plain path, as users pass to FileSystemWriter
    writer = objckpt.ObjectStoreWriter(url)
    with quiet():
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, planner=Spy())
    assert writer.last_manifest is not None
    assert seen["meta"].checkpoint_id == url
    assert seen["meta"].save_id == writer.last_manifest.attempt
    reader = objckpt.ObjectStoreReader(url)
    assert reader.read_metadata().storage_meta.checkpoint_id == url
    first = reader.load_id
    reader.reset(url)
    assert reader.load_id and reader.load_id != first


def test_objckpt_load_planner_plans_with_any_reader(target: StoreTarget) -> None:
    """``planner=objckpt.LoadPlanner()`` in a plain ``dcp.load``: with objckpt's reader,
    and with a stock reader on a stock checkpoint (DCP's own planning then)."""
    state = sample_state(big=100_000)
    save(state, target.url("ours-planned"), target)
    got = empty_like_state(state)
    with quiet():
        dcp.load(
            got,
            storage_reader=objckpt.ObjectStoreReader(
                target.url("ours-planned"), storage_options=target.storage_options
            ),
            planner=objckpt.LoadPlanner(),
        )
    assert_state_equal(got, state)
    with quiet():
        dcp.save(
            state,
            storage_writer=FsspecWriter(
                _fsspec_path(target, "stock-planned"), sync_files=False, **target.storage_options
            ),
        )
    got = empty_like_state(state)
    with quiet():
        dcp.load(
            got,
            storage_reader=FsspecReader(
                _fsspec_path(target, "stock-planned"), **target.storage_options
            ),
            planner=objckpt.LoadPlanner(),
        )
    assert_state_equal(got, state)
