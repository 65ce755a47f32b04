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


def _state(seed: int) -> dict:
    # 16 KiB tensors, four to a 64 KiB object: four objects to spread
    return {f"layer{i}": torch.full((64, 64), float(seed * 100 + i)) for i in range(16)}


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


def test_spread_keys_are_placed_in_front_of_their_step() -> None:
    """One grammar for where a key is stored (``Location.key_path``, ``root_key``,
    the live set's ``step_dir_of``, the commit's listings): a spread key of a step
    directory sits in front of the step, a reference to it by its step, and a
    checkpoint that is no step directory keeps it inside."""
    from objckpt.format.refs import reference_key, root_key, stock_path
    from objckpt.ops.maintain.live_set import step_dir_of
    from objckpt.writers.location import placed, unplaced

    one, two = step_name(1), step_name(2)
    name = f"__0_1.{'a' * 16}.distcp"
    key = payload_key(0, 1, "a" * 16, 2, persistent=True)
    assert key.startswith("spread-") and key.endswith("/" + name)
    assert payload_key(0, 1, "a" * 16, 2).split("/")[0] == key.split("/")[0][len("spread-") :]
    spread = key.split("/")[0]
    step = Location.parse("s3://b/run").child(two)
    assert step.key_path(key) == f"b/run/{spread}/{two}/{name}"
    assert step.url_of(key) == f"s3://b/run/{spread}/{two}/{name}"
    assert step.listing_root(key).url == f"s3://b/run/{spread}/{two}"
    ref = reference_key(one, key)
    assert ref == f"../{one}/{key}"
    assert step.key_path(ref) == f"b/run/{spread}/{one}/{name}"
    assert step.listing_root(ref).url == f"s3://b/run/{spread}/{one}"
    assert step.listing_root(f"../{one}/3f/{name}").url == f"s3://b/run/{one}"
    assert step.listing_root("3f/" + name) == step
    assert root_key(two, key) == placed(two, key) == f"{spread}/{two}/{name}"
    assert root_key(two, ref) == f"{spread}/{one}/{name}"
    assert unplaced(f"{spread}/{two}/{name}") == (two, key)
    assert unplaced(f"{two}/3f/{name}") == (two, f"3f/{name}")
    assert unplaced(f"{spread}/notes/x") is None and unplaced(f"{spread}/{two}/a/b") is None
    assert step_dir_of(f"{spread}/{two}/{name}") == two and step_dir_of("spread-3/x") is None
    assert stock_path(step.url, key) == f"../{spread}/{two}/{name}"
    assert stock_path(step.url, ref) == f"../{spread}/{one}/{name}"
    assert stock_path(step.url, f"../{one}/{name}") == f"../{one}/{name}"
    assert stock_path(step.url, "3f/" + name) == "3f/" + name
    plain = Location.parse("s3://b/ckpt")  # no step directory: the key stays inside
    assert plain.key_path(key) == f"b/ckpt/{key}" and plain.listing_root(key) == plain
    assert stock_path(plain.url, key) == key
    assert is_entropy_dir(spread) and not is_entropy_dir("spread-")
