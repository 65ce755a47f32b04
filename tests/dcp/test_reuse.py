"""Reuse of unchanged bytes (#28): what a save uploads, what it references, and loads.

A LoRA-shaped run (a frozen 32 MiB base, small trained adapters and their optimizer
state) saved through the recording proxy: later steps upload only what changed and
load bit-exact; the option turns it off; a referenced object deleted before the
commit fails the save; crafted bases that must never be reused are not.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import load, save
from reuse_helpers import lora_state, stored_items, train_step

from objckpt import AsyncCheckpointer, AsyncOptions, CheckpointManager, Location, RetentionPolicy
from objckpt.errors import UploadError
from objckpt.format import columns
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import Manifest, read_manifest
from objckpt.format.refs import is_reference
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

_UPLOADS = ("PutObject", "UploadPart")


def _manifest(target: StoreTarget, url: str) -> Manifest:
    return read_manifest(open_store(Location.parse(url, target.storage_options)))


def _through(proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=proxy.storage_options())


def _uploaded_per_step(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, reuse: bool
) -> tuple[list[int], dict]:
    """Steps 1-3 of the LoRA run by a manager through the proxy: bytes PUT per step."""
    target = _through(s3_proxy, s3_bucket)
    state = lora_state()
    sent = []
    with CheckpointManager(
        target.url("lora"),
        storage_options=target.storage_options,
        async_options=AsyncOptions(workers=1),
        reuse_unchanged=reuse,
    ) as mgr:
        for step in (1, 2, 3):
            if step > 1:
                train_step(state, step)
            s3_proxy.clear()
            mgr.save(step, state).result(timeout=120)
            sent.append(s3_proxy.sent_bytes(*_UPLOADS))
    return sent, state


def test_lora_steps_after_the_first_upload_a_tenth_and_load_bit_exact(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    sent, state = _uploaded_per_step(s3_proxy, s3_bucket, reuse=True)
    assert sent[0] > 32 * 2**20, sent
    assert sent[1] <= sent[0] // 10 and sent[2] <= sent[0] // 10, sent
    step3 = _manifest(s3_bucket, s3_bucket.url(f"lora/{step_name(3)}"))
    assert step3.written_version == 3 and step3.reused_bytes >= 32 * 2**20
    # The base is referenced where step 1 stores it (never a chain through step 2).
    assert {o.key.split("/")[1] for o in step3.objects if is_reference(o.key)} == {step_name(1)}
    got = empty_like_state(state)
    with CheckpointManager(s3_bucket.url("lora"), storage_options=s3_bucket.storage_options) as mgr:
        assert mgr.load(got) == 3
    assert_state_equal(got, state)


def test_reuse_off_uploads_everything(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> None:
    sent, _ = _uploaded_per_step(s3_proxy, s3_bucket, reuse=False)
    assert min(sent[1:]) >= sent[0] * 0.99, sent
    for step in (2, 3):
        manifest = _manifest(s3_bucket, s3_bucket.url(f"lora/{step_name(step)}"))
        assert manifest.written_version == 2 and manifest.reused_bytes == 0
        assert not any(is_reference(o.key) for o in manifest.objects)


def test_a_referenced_object_deleted_before_the_commit_fails_the_save(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """The race of #28 item 3: the save looked its base up, then the base's object
    went (another process's gc, an ``rm``): the commit's check finds it gone, the
    save fails naming the object and the referenced step, and nothing is committed."""
    target = _through(s3_proxy, s3_bucket)
    state = lora_state()
    with CheckpointManager(
        target.url("race"),
        storage_options=target.storage_options,
        async_options=AsyncOptions(workers=1),
    ) as mgr:
        mgr.save(1, state).result(timeout=120)
        train_step(state, 2)
        # Held: step 2's index PUT, which the commit makes before its listings.
        s3_proxy.add(Rule(key_contains=f"{step_name(2)}/__index_", action="hold", stall=120))
        handle = mgr.save(2, state)
        s3_proxy.wait_for("PutObject", faulted=True)
        base = _manifest(s3_bucket, s3_bucket.url(f"race/{step_name(1)}"))
        payload = next(o.key for o in base.objects if o.key.endswith(".distcp"))
        moto_server.boto3_client().delete_object(
            Bucket=s3_bucket.bucket, Key=f"t/race/{step_name(1)}/{payload}"
        )
        s3_proxy.release()
        with pytest.raises(UploadError) as info:
            handle.result(timeout=120)
        assert payload in str(info.value) and step_name(1) in str(info.value), info.value
        assert "nothing was committed" in str(info.value)
        with pytest.raises(UploadError):
            mgr.check_for_errors()
    with pytest.raises(FileNotFoundError):
        _manifest(s3_bucket, s3_bucket.url(f"race/{step_name(2)}"))


def _craft_index(target: StoreTarget, url: str, change) -> None:
    """Rewrite the (one) index object of the committed step ``url`` with ``change``
    applied to its JSON, and its manifest entry to match (as a crafted bucket can)."""
    from objckpt.writers.checksum import Crc32c

    store = open_store(Location.parse(url, target.storage_options))
    manifest = read_manifest(store)
    entry = next(o for o in manifest.objects if o.key.startswith("__index_"))
    doc = json.loads(store.read(entry.key))
    change(doc)
    blob = json.dumps(doc, separators=(",", ":")).encode()
    crc = Crc32c()
    crc.update(blob)
    raw = json.loads(store.read(MANIFEST_KEY))
    for o in raw["objects"]:
        if o["key"] == entry.key:
            o["size"], o["crc32c"] = len(blob), crc.hexdigest()
    raw["total_bytes"] = sum(o["size"] for o in raw["objects"])
    store.put(entry.key, blob)
    store.put(MANIFEST_KEY, json.dumps(raw).encode())


def _same_state_twice(target: StoreTarget, crafted) -> tuple[dict, dict]:
    """Save the same small state as step 1, craft step 1's index, save it as step 2
    reusing step 1; step 2's stored items by fqn, and the state."""
    state = {"a": torch.arange(1000.0), "b": torch.ones(7, 7), "c": {"n": 3}}
    one, two = target.url(f"run/{step_name(1)}"), target.url(f"run/{step_name(2)}")
    save(state, one, target)
    _craft_index(target, one, crafted)
    save(state, two, target, reuse_from=one)
    return {i.fqn: item for i, item in stored_items(two, target).items()}, state


def test_a_base_item_with_the_same_hash_but_another_length_is_not_reused(
    s3_bucket: StoreTarget,
) -> None:
    def longer_a(doc: dict) -> None:
        n = len(doc["crc32c"]) // 8
        fqns = columns.unpack(doc["fqn"], n, "fqn")
        lengths = columns.unpack(doc["length"], n, "length")
        lengths[fqns.index(doc["fqns"].index("a"))] -= 1  # the hash stays as it was
        doc["length"] = columns.pack(lengths)

    items, state = _same_state_twice(s3_bucket, longer_a)
    assert not is_reference(items["a"].relative_path), items["a"]
    assert is_reference(items["b"].relative_path) and is_reference(items["c.n"].relative_path)
    got = empty_like_state(state)
    load(got, s3_bucket.url(f"run/{step_name(2)}"), s3_bucket)
    assert_state_equal(got, state)


def test_a_base_written_before_item_hashes_is_never_reused(s3_bucket: StoreTarget) -> None:
    items, _ = _same_state_twice(s3_bucket, lambda doc: doc.pop("xxh3"))
    assert not any(is_reference(i.relative_path) for i in items.values()), items
    manifest = _manifest(s3_bucket, s3_bucket.url(f"run/{step_name(2)}"))
    assert manifest.written_version == 2 and manifest.reused_bytes == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_unchanged_state_creates_no_payload_object(
    mode: str, s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    """Every item reused: no payload object is created (not even an empty one), only
    the step's index, manifest and ``.metadata``; by the synchronous writer and by the
    upload workers of an async save."""
    target = _through(s3_proxy, s3_bucket)
    state = {"w": torch.randn(64, 64), "v": {"k": [1, 2]}}
    one, two = target.url(f"run/{step_name(1)}"), target.url(f"run/{step_name(2)}")
    save(state, one, target)
    s3_proxy.clear()
    if mode == "sync":
        save(state, two, target, reuse_from=one)
    else:
        options = AsyncOptions(workers=1)
        with AsyncCheckpointer(storage_options=target.storage_options, async_options=options) as c:
            c.save(state, two, reuse_from=one).result(timeout=120)
    written = s3_proxy.paths("PutObject") + s3_proxy.paths("CreateMultipartUpload")
    assert not [p for p in written if ".distcp" in p], written
    assert any(MANIFEST_KEY in p for p in written), written
    got = empty_like_state(state)
    load(got, two, target)
    assert_state_equal(got, state)


def test_the_config_file_turns_reuse_off() -> None:
    from objckpt.errors import ConfigurationError
    from objckpt.ops.run.config import parse_config

    assert parse_config('root = "s3://b/r"').manager_options()["reuse_unchanged"] is True
    off = parse_config('root = "s3://b/r"\nreuse_unchanged = false')
    assert off.manager_options()["reuse_unchanged"] is False
    with pytest.raises(ConfigurationError, match="reuse_unchanged must be true or false"):
        parse_config('root = "s3://b/r"\nreuse_unchanged = "no"', source="run.toml")


def test_with_keep_last_1_and_gc_at_zero_grace_step_3_loads_and_verifies(
    s3_bucket: StoreTarget,
) -> None:
    """The issue's lifecycle check from the save side: retention drops steps 1 and 2,
    gc runs with no grace, and step 3 (whose base bytes step 1 stored) is still whole."""
    from objckpt.ops.maintain.verify import verify_checkpoint

    root = s3_bucket.url("k1")
    state = lora_state()
    with CheckpointManager(
        root,
        storage_options=s3_bucket.storage_options,
        retention=RetentionPolicy(keep_last=1),
        async_options=AsyncOptions(workers=1),
    ) as mgr:
        for step in (1, 2, 3):
            if step > 1:
                train_step(state, step)
            mgr.save(step, state).result(timeout=120)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
        mgr.gc(grace=0.0, dry_run=False)
        got = empty_like_state(state)
        assert mgr.load(got) == 3
    assert_state_equal(got, state)
    step3 = _manifest(s3_bucket, f"{root}/{step_name(3)}")
    assert step3.reused_bytes >= 32 * 2**20
    report = verify_checkpoint(Location.parse(f"{root}/{step_name(3)}", s3_bucket.storage_options))
    assert report.ok, report.failures


def test_references_into_prefixed_keys_load_and_are_checked_at_the_commit(
    s3_bucket: StoreTarget,
) -> None:
    """With prefix entropy a payload key has a directory of its own
    (``3f/__0_0.<a>.distcp``): its reference keeps it, the commit's listing of the
    referenced step finds it, and the load resolves it."""
    from objckpt import UploadOptions

    upload = UploadOptions(prefix_entropy=2)
    state = {"frozen": torch.randn(128, 128), "trained": torch.zeros(4)}
    one, two = s3_bucket.url(f"run/{step_name(1)}"), s3_bucket.url(f"run/{step_name(2)}")
    save(state, one, s3_bucket, upload=upload)
    state["trained"] += 1
    save(state, two, s3_bucket, upload=upload, reuse_from=one)
    items = {i.fqn: item for i, item in stored_items(two, s3_bucket).items()}
    ref = items["frozen"].relative_path
    assert ref.startswith(f"../{step_name(1)}/") and ref.count("/") == 3, ref
    assert not is_reference(items["trained"].relative_path)
    got = empty_like_state(state)
    load(got, two, s3_bucket)
    assert_state_equal(got, state)
