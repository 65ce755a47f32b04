"""Prefix entropy: payload keys under hashed sub-prefixes, the checkpoint still one unit."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import fs_of, load, save

from objckpt import CheckpointManager, Location, RetentionPolicy, UploadOptions
from objckpt.errors import CheckpointNotCommittedError, ConfigurationError
from objckpt.format.layout import MANIFEST_KEY, is_entropy_dir, is_objckpt_payload, payload_key
from objckpt.format.steps import step_name
from objckpt.ops.maintain.gc import collect_garbage, delete_step
from objckpt.testing.plugin import StoreTarget

SPREAD = UploadOptions(object_size=64 * 1024, prefix_entropy=2)


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path) -> StoreTarget:
    if request.param == "file":
        return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    return request.getfixturevalue("s3_bucket")


def _state(seed: int) -> dict:
    return {f"layer{i}": torch.full((64, 64), float(seed * 100 + i)) for i in range(12)}


def test_keys_spread_over_prefixes_and_the_step_stays_one_unit(target: StoreTarget) -> None:
    root = target.url("run")
    with CheckpointManager(
        root,
        storage_options=target.storage_options,
        upload=SPREAD,
        retention=RetentionPolicy(keep_last=1),
    ) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 2
        assert_state_equal(got, _state(2))
        assert mgr.all_steps() == [2]  # step 1, sub-prefixes and all, deleted by retention
    step = Location.parse(root, target.storage_options).child(step_name(2))
    fs = fs_of(target)
    keys = sorted(p[len(step.path) + 1 :] for p in fs.find(step.path))
    payloads = [k for k in keys if is_objckpt_payload(k)]
    assert len(payloads) >= 4
    assert all(is_entropy_dir(k.split("/")[0]) and len(k.split("/")[0]) == 2 for k in payloads)
    assert len({k.split("/")[0] for k in payloads}) >= 2
    assert MANIFEST_KEY in keys
    report = collect_garbage(Location.parse(root, target.storage_options), grace=0)
    assert report.deleted == ()
    assert delete_step(step) == len(keys)
    assert fs.find(Location.parse(root, target.storage_options).path) == []


def test_uncommitted_spread_step_is_named_as_such(target: StoreTarget) -> None:
    url = target.url("ck")
    save(_state(3), url, target, upload=SPREAD)
    fs = fs_of(target)
    fs.rm(Location.parse(url, target.storage_options).key_path(MANIFEST_KEY))
    with pytest.raises(CheckpointNotCommittedError):
        load(empty_like_state(_state(0)), url, target)


def test_option_and_key_shape() -> None:
    assert payload_key(0, 1, "a" * 16) == "__0_1.aaaaaaaaaaaaaaaa.distcp"
    spread = payload_key(0, 1, "a" * 16, 3)
    assert len(spread.split("/")[0]) == 3 and spread.endswith("/__0_1.aaaaaaaaaaaaaaaa.distcp")
    assert payload_key(0, 1, "a" * 16, 3) == spread  # stable
    with pytest.raises(ConfigurationError, match="prefix_entropy=9"):
        UploadOptions(prefix_entropy=9)
