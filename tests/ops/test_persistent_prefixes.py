"""Persistent prefixes (#46): a step's payloads in spread directories in front of the
step (``<root>/spread-3f/step-<N>/…``), and the root still one set of steps for
load, retention, reuse, gc, backups, ``rm`` and stock DCP readers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state
from helpers import fs_of, load, save

from objckpt import CheckpointManager, LocalTier, Location, RetentionPolicy, UploadOptions
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import ConfigurationError, ManifestError, UploadError
from objckpt.format.layout import MANIFEST_KEY, is_objckpt_payload
from objckpt.format.manifest import SPREAD_VERSION, Manifest, ObjectEntry, read_manifest
from objckpt.format.ref_check import require_referenced
from objckpt.format.refs import root_key
from objckpt.format.settle import require_present
from objckpt.format.steps import step_name, steps_of
from objckpt.ops.maintain.gc import collect_garbage, delete_step
from objckpt.ops.maintain.retire import retire_steps
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

SPREAD = UploadOptions(object_size=64 * 1024, prefix_entropy=1, persistent_prefixes=True)


def _state(seed: int, frozen: float = 7.0) -> dict:
    state = {f"layer{i}": torch.full((64, 64), float(seed * 100 + i)) for i in range(8)}
    state["frozen"] = torch.full((128, 128), frozen)
    return state


def _keys(target: StoreTarget, root: str) -> list[str]:
    """Every object under ``root``, relative to it (what is stored, not what is named)."""
    where = Location.parse(root, target.storage_options)
    return sorted(p[len(where.path) + 1 :] for p in fs_of(target).find(where.path))


def _keep_one(target: StoreTarget, root: str, *, reuse: bool) -> CheckpointManager:
    return CheckpointManager(
        root,
        storage_options=target.storage_options,
        upload=SPREAD,
        retention=RetentionPolicy(keep_last=1),
        reuse_unchanged=reuse,
    )


def test_payloads_go_in_front_of_the_step_and_retention_takes_them(target: StoreTarget) -> None:
    root = target.url("run")
    with _keep_one(target, root, reuse=False) as mgr:
        mgr.save(1, _state(1)).result()
        first = _keys(target, root)
        mgr.save(2, _state(2)).result()
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 2
        assert_state_equal(got, _state(2))
        assert mgr.all_steps() == [2]
    one, two = step_name(1), step_name(2)
    spread_one = [k for k in first if k.startswith("spread-")]
    assert len({k.split("/")[0] for k in spread_one}) >= 2, first  # over prefixes
    assert all(k.split("/")[1] == one and is_objckpt_payload(k) for k in spread_one), first
    assert not any(is_objckpt_payload(k) for k in first if k.startswith(one + "/")), first
    keys = _keys(target, root)
    assert not any(one in k for k in keys), keys  # step 1, spread objects and all, retired
    payloads = [k for k in keys if is_objckpt_payload(k)]
    assert payloads and all(k.startswith("spread-") and k.split("/")[1] == two for k in payloads), (
        keys
    )
    step = Location.parse(root, target.storage_options).child(two)
    manifest = json.loads(fs_of(target).cat_file(step.key_path(MANIFEST_KEY)))
    assert manifest["version"] == SPREAD_VERSION
    assert all(o["key"].startswith("spread-") for o in manifest["objects"] if "distcp" in o["key"])
    assert verify_checkpoint(step).ok
    report = collect_garbage(Location.parse(root, target.storage_options), grace=0, dry_run=False)
    assert report.deleted == ()
    assert delete_step(step) == len(keys)
    assert _keys(target, root) == []
    if step.is_local:  # no directory left on disk but the spread ones, emptied
        fs = fs_of(target)
        left = fs.ls(Location.parse(root).path, detail=False)
        assert left and all(p.rsplit("/", 1)[-1].startswith("spread-") for p in left), left
        assert all(fs.ls(p) == [] for p in left), left


def test_reuse_keeps_referenced_spread_objects_until_the_last_referrer_goes(
    target: StoreTarget,
) -> None:
    root = target.url("run")
    with _keep_one(target, root, reuse=True) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()  # "frozen" unchanged: referenced in step 1
        assert mgr.all_steps() == [2]
        step = Location.parse(root, target.storage_options).child(step_name(2))
        refs = [
            o["key"]
            for o in json.loads(fs_of(target).cat_file(step.key_path(MANIFEST_KEY)))["objects"]
            if o["key"].startswith("../")
        ]
        assert refs and all(r.startswith(f"../{step_name(1)}/spread-") for r in refs), refs
        kept = [k for k in _keys(target, root) if step_name(1) in k]
        assert kept == sorted(root_key(step_name(2), r) for r in refs)  # only what 2 needs
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 2
        assert_state_equal(got, _state(2))
        mgr.save(3, _state(3, frozen=8.0)).result()  # nothing of step 1 referenced now
        assert mgr.all_steps() == [3]
    keys = _keys(target, root)
    assert not any(step_name(2) in k for k in keys), keys
    # What step 2 referenced in step 1 goes once older than the grace (a save in
    # flight may be about to reference it), as without spread directories.
    assert [k for k in keys if step_name(1) in k] == kept
    collect_garbage(Location.parse(root, target.storage_options), grace=0, dry_run=False)
    keys = _keys(target, root)
    assert not any(step_name(1) in k for k in keys) and any(step_name(3) in k for k in keys)


def test_gc_takes_a_failed_saves_spread_objects_and_nothing_that_is_not_ours(
    target: StoreTarget,
) -> None:
    root = target.url("run")
    with CheckpointManager(
        root, storage_options=target.storage_options, upload=SPREAD, reuse_unchanged=False
    ) as mgr:
        mgr.save(1, _state(1)).result()
    fs = fs_of(target)
    where = Location.parse(root, target.storage_options)
    stray = f"spread-3/{step_name(9)}/__0_0.{'a' * 16}.distcp"
    foreign = "spread-3/notes/readme.txt"
    beside = f"spread-3/{step_name(42)}/readme.txt"  # not objckpt's: no step 42 either
    for key in (stray, foreign, beside):
        fs.makedirs(where.key_path(key).rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(where.key_path(key), b"x" * 10)
    assert [s.step for s in steps_of(open_store(where).inventory(), where)] == [1, 9]
    report = collect_garbage(where, grace=0, dry_run=False)
    assert report.deleted == (stray,)
    keys = _keys(target, root)
    assert foreign in keys and beside in keys and stray not in keys
    got = empty_like_state(_state(0))
    load(got, where.child(step_name(1)).url, target)
    assert_state_equal(got, _state(1))


def test_commit_refuses_a_spread_object_gone_before_it(s3_bucket: StoreTarget) -> None:
    """The commit's presence check lists each spread directory's share of the step:
    an object deleted there since it was written fails the commit, named."""
    url = s3_bucket.url(f"run/{step_name(4)}")
    save(_state(4), url, s3_bucket, upload=SPREAD)
    store = open_store(Location.parse(url, s3_bucket.storage_options))
    try:
        manifest = Manifest.from_json_bytes(store.read(MANIFEST_KEY), url=url)
        payloads = [o for o in manifest.objects if is_objckpt_payload(o.key)]
        require_present(store, payloads)  # all there: passes
        store.delete_many([payloads[0].key])
        with pytest.raises(UploadError, match=re.escape(payloads[0].key)):
            require_present(store, payloads)
        with pytest.raises(UploadError, match="another size"):
            require_present(store, [ObjectEntry(payloads[1].key, 1, payloads[1].crc32c)])
    finally:
        store.close()


def test_stock_dcp_reader_loads_a_spread_step_with_references(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``.metadata`` names each spread or referenced object by its place under the
    root (``../spread-3/step-…/…``), which a local filesystem resolves; step 3's is
    step 2's renamed (the same items: own ones and the same references), its own
    step's name included."""
    from objckpt.format import commit

    built: list[str] = []
    real = commit.build_stock

    def counted(layout: object, attempt: str, *args: object, **kwargs: object) -> object:
        built.append(attempt)
        return real(layout, attempt, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(commit, "build_stock", counted)
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root, upload=SPREAD, reuse_unchanged=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).result()
    assert len(built) == 2  # steps 1 and 2 (its first references): 3 from the template
    for step in (2, 3):
        got = empty_like_state(_state(0))
        reader = dcp.FileSystemReader(str(tmp_path / "run" / step_name(step)))
        dcp.load(got, storage_reader=reader)
        assert_state_equal(got, _state(step))


def test_the_option_is_refused_where_it_cannot_hold(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="persistent_prefixes=True"):
        UploadOptions(persistent_prefixes=True)  # no digits to keep
    with pytest.raises(ConfigurationError, match="persistent_prefixes=1"):
        UploadOptions(prefix_entropy=1, persistent_prefixes=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="step directory of a root"):
        ObjectStoreWriter(f"file://{tmp_path}/ckpt", upload=SPREAD)
    with pytest.raises(ConfigurationError, match="below the bucket"):
        ObjectStoreWriter(f"s3://bucket/{step_name(1)}", upload=SPREAD)
    ObjectStoreWriter(f"memory://run/{step_name(1)}", upload=SPREAD)  # no bucket there
    writer = ObjectStoreWriter(f"file://{tmp_path}/run/{step_name(1)}", upload=SPREAD)
    with pytest.raises(ConfigurationError, match="step directory of a root"):
        writer.reset(f"file://{tmp_path}/elsewhere")
    with pytest.raises(ConfigurationError, match="local tier"):
        CheckpointManager(
            f"file://{tmp_path}/r", upload=SPREAD, local=LocalTier(str(tmp_path / "node"))
        )


def test_an_older_format_with_a_spread_key_is_refused() -> None:
    doc = {
        "format": "objckpt.manifest",
        "version": 3,
        "attempt": "a" * 16,
        "created": "2026-12-06T00:00:00+00:00",
        "world_size": 1,
        "objects": [
            {"key": "spread-3/__0_0.aaaaaaaaaaaaaaaa.distcp", "size": 1, "crc32c": "0" * 8}
        ],
        "metadata": {},
    }
    with pytest.raises(ManifestError, match="spread keys need format 4"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), url="s3://b/r/step-0000000001")


def test_a_backup_keeps_the_spread_layout_and_loads(s3_bucket: StoreTarget, tmp_path) -> None:
    root, backup = s3_bucket.url("run"), f"file://{tmp_path}/backup"
    with CheckpointManager(
        root,
        storage_options=s3_bucket.storage_options,
        upload=SPREAD,
        retention=RetentionPolicy(keep_last=1),
        backups=[backup],
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step)).result()
            mgr.wait_until_finished()
        mgr.wait_for_backups(timeout=120)
    target = StoreTarget(root=backup, storage_options={})
    keys = _keys(target, backup)
    payloads = [k for k in keys if is_objckpt_payload(k)]
    assert payloads and all(k.startswith("spread-") for k in payloads), keys
    got = empty_like_state(_state(0))
    load(got, f"{backup}/{step_name(2)}", target)
    assert_state_equal(got, _state(2))
    assert verify_checkpoint(Location.parse(backup).child(step_name(2))).ok
    # The backup's retention (the primary's policy) pruned what it emptied on disk.
    assert not [p for p in (tmp_path / "backup").rglob("*") if p.is_dir() and not any(p.iterdir())]


def _two_steps(target: StoreTarget) -> tuple[Location, Location]:
    """Step 1, and step 2 reusing step 1's ``frozen`` (a reference into a spread
    directory), saved by plain writers."""
    root = Location.parse(target.url("run"), target.storage_options)
    one, two = root.child(step_name(1)), root.child(step_name(2))
    save(_state(1), one.url, target, upload=SPREAD)
    save(_state(2), two.url, target, upload=SPREAD, reuse_from=one.url)
    return one, two


def _manifest(where: Location) -> Manifest:
    store = open_store(where)
    try:
        return read_manifest(store)
    finally:
        store.close()


def test_the_commit_lists_a_referenced_steps_spread_directories(s3_bucket: StoreTarget) -> None:
    """A reference to another step's spread object is proven present by a listing of
    that spread directory's share of the step, and the base's manifest by one of
    the base's directory: either gone fails the commit, named."""
    one, two = _two_steps(s3_bucket)
    store = open_store(two, SPREAD)
    try:
        manifest = Manifest.from_json_bytes(store.read(MANIFEST_KEY), url=two.url)
        refs = [o for o in manifest.objects if o.key.startswith("../")]
        assert refs and all("/spread-" in o.key for o in refs)
        assert manifest.written_version == SPREAD_VERSION
        require_referenced(store, refs, base=step_name(1))  # all there: passes
        base = store.at(one)
        committed = base.read(MANIFEST_KEY)
        base.delete_many([MANIFEST_KEY])
        with pytest.raises(UploadError, match=r"manifest\.json is gone"):
            require_referenced(store, refs, base=step_name(1))
        base.put(MANIFEST_KEY, committed)
        require_referenced(store, refs, base=step_name(1))
        inner = refs[0].key.split("/", 2)[2]
        base.delete_many([inner])
        with pytest.raises(UploadError, match=re.escape(inner)):
            require_referenced(store, refs, base=step_name(1))
    finally:
        store.close()


def test_a_manifest_that_only_references_spread_objects_is_format_4(
    s3_bucket: StoreTarget,
) -> None:
    _, two = _two_steps(s3_bucket)
    manifest = _manifest(two)
    refs = tuple(o for o in manifest.objects if o.key.startswith("../"))
    only = dataclasses.replace(manifest, objects=refs, metadata={}, version=2)
    assert only.written_version == SPREAD_VERSION  # unfixed: 3, which older readers misread
    doc = json.loads(only.to_json_bytes())
    doc["version"] = 3
    with pytest.raises(ManifestError, match="spread keys need format 4"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), url=two.url)


def test_gc_of_a_step_directory_never_deletes_through_a_spread_key(
    s3_bucket: StoreTarget,
) -> None:
    """Step 1 retired, step 2 still references its spread object. An object planted
    at ``<step 1>/spread-…/<name>`` lists as the spread key ``spread-…/<name>``,
    which the store places at ``spread-…/<step 1>/<name>``: step 2's live object.
    gc of step 1's directory leaves it alone, and step 2 loads."""
    one, two = _two_steps(s3_bucket)
    manifest = _manifest(two)
    inner = next(o.key for o in manifest.objects if o.key.startswith("../")).split("/", 2)[2]
    retire_steps(one.parent(), [1], grace=0)
    fs = fs_of(s3_bucket)
    assert fs.exists(one.key_path(inner))  # kept: step 2 references it
    fs.pipe_file(f"{one.path}/{inner}", b"planted")
    collect_garbage(one, grace=0, dry_run=False)
    assert fs.exists(one.key_path(inner))  # unfixed: deleted through the planted name
    got = empty_like_state(_state(0))
    load(got, two.url, s3_bucket)
    assert_state_equal(got, _state(2))


def test_a_copy_keeps_the_steps_name_or_is_refused(s3_bucket: StoreTarget, tmp_path) -> None:
    """``.metadata`` names a spread step's objects by its step: a copy under another
    name would send stock readers to another step's objects, so it is refused; a
    copy into a step directory of the same name (a backup's) loads."""
    one, _ = _two_steps(s3_bucket)
    elsewhere = Location.parse(f"file://{tmp_path}/other").child(step_name(9))
    with pytest.raises(ConfigurationError, match="same name"):
        copy_checkpoint(one, elsewhere)
    with pytest.raises(ConfigurationError, match="same name"):
        copy_checkpoint(one, Location.parse(f"file://{tmp_path}/ckpt"))
    top = Location.parse(f"s3://{s3_bucket.bucket}/{step_name(1)}", s3_bucket.storage_options)
    with pytest.raises(ConfigurationError, match="under a root"):
        copy_checkpoint(one, top)  # its spread directories would be the bucket's own
    same = Location.parse(f"file://{tmp_path}/other").child(step_name(1))
    copy_checkpoint(one, same)
    got = empty_like_state(_state(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "other" / step_name(1))))
    assert_state_equal(got, _state(1))


def test_the_commit_lists_the_spread_directories_at_once(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The commit's presence check lists the step's directory and each spread
    directory's share of it concurrently (one after another, 256 spread directories
    were seconds of rank 0's commit): with every listing held by the proxy, two or more
    are in flight at once, and the check still finds every object."""
    step = s3_bucket.url(f"run/{step_name(1)}")
    save(_state(1), step, s3_bucket, upload=SPREAD)
    store = open_store(Location.parse(step, s3_proxy.storage_options()), SPREAD)
    try:
        manifest = read_manifest(store)
        assert len({o.key.split("/")[0] for o in manifest.objects if "/" in o.key}) > 1
        s3_proxy.add(Rule(operation="ListObjectsV2", action="hold", stall=120))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            checked = pool.submit(require_present, store, manifest.objects)
            try:
                # Well inside the client's read timeout (60 s): a listing one after
                # another is not retried (a second request) before this gives up.
                s3_proxy.wait_for("ListObjectsV2", faulted=True, count=2, timeout=20)
            finally:
                s3_proxy.release()
            checked.result(timeout=60)  # every object found: no error
    finally:
        store.close()
