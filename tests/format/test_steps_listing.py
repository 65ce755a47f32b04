"""Which steps are committed, found without listing every rank's objects.

``committed_steps`` is what the manager asks on rank 0 in its constructor and in every
load. Its requests must not depend on how many objects a step holds (a step of W ranks
holds ~2W objects): one LIST of the root's top level and one HEAD per step directory.
Counted on the wire through the recording proxy in front of moto.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from objckpt.errors import BucketNotFoundError, StoreError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import committed_steps, step_name, steps_of
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.rules import Rule
from objckpt.writers import open_store
from objckpt.writers.location import Location

COMMITTED = (3, 7, 12)
UNCOMMITTED = 9


def _fill(fs: Any, root: Location, objects_per_step: int) -> None:
    """Steps 3, 7 and 12 committed (a manifest), step 9 not, each with
    ``objects_per_step`` payload-like objects; plus objects no step owns."""
    files: dict[str, bytes] = {}
    for step in (*COMMITTED, UNCOMMITTED):
        base = root.path.rstrip("/") + "/" + step_name(step)
        for i in range(objects_per_step):
            files[f"{base}/__{i}_0.a1b2.distcp"] = b"x" * 7
        if step in COMMITTED:
            files[f"{base}/{MANIFEST_KEY}"] = json.dumps({"step": step}).encode()
    top = root.path.rstrip("/")
    files[f"{top}/objckpt.json"] = b"{}"
    files[f"{top}/notes/{MANIFEST_KEY}"] = b"{}"  # not a step directory
    files[f"{top}/step-12/{MANIFEST_KEY}"] = b"{}"  # too few digits: not a step either
    for parent in {k.rsplit("/", 1)[0] for k in files}:
        fs.makedirs(parent, exist_ok=True)  # a local root needs its directories
    fs.pipe(files)


def _ops(proxy: FaultProxy) -> dict[str, int]:
    return {op: proxy.count(op) for op in sorted(proxy.operations())}


def test_s3_requests_do_not_grow_with_the_objects_a_step_holds(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    root = Location.parse(s3_bucket.root, s3_proxy.storage_options())
    fs = root.open_fs()
    seen = []
    for per_step in (4, 400):  # 4 steps x 400 objects: the recursive listing pages twice
        _fill(fs, root, per_step)
        s3_proxy.clear()
        found = committed_steps(open_store(root))
        assert [s.step for s in found] == list(COMMITTED)
        assert all(s.committed and s.url == root.child(step_name(s.step)).url for s in found)
        assert all(s.modified is not None for s in found)
        seen.append((_ops(s3_proxy), s3_proxy.received_bytes("ListObjectsV2")))
    (small, small_bytes), (large, large_bytes) = seen
    # One LIST of the root; one HEAD per step directory; the uncommitted step's missing
    # manifest costs s3fs one more LIST (is it a directory?), as many at any size.
    assert small == large, f"requests at 4 objects per step {small}, at 400 {large}"
    assert small["HeadObject"] == len(COMMITTED) + 1, small
    assert small.get("GetObject", 0) == 0, small
    assert large_bytes == small_bytes, (small_bytes, large_bytes)
    # The old way, for contrast: one recursive listing pays for every object.
    s3_proxy.clear()
    assert [s.step for s in steps_of(open_store(root).inventory(), root) if s.committed] == list(
        COMMITTED
    )
    assert s3_proxy.count("ListObjectsV2") >= 2
    assert s3_proxy.received_bytes("ListObjectsV2") > 10 * large_bytes


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_local_and_memory_roots(scheme: str, tmp_path: Any) -> None:
    url = f"file://{tmp_path}/root" if scheme == "file" else f"memory://steps-{id(tmp_path)}"
    root = Location.parse(url)
    fs = root.open_fs()
    _fill(fs, root, 3)
    found = committed_steps(open_store(root))
    assert [s.step for s in found] == list(COMMITTED)
    assert [s.bytes for s in found] == [len(json.dumps({"step": s}).encode()) for s in COMMITTED]
    # The same answer as the recursive inventory's.
    listed = [s.step for s in steps_of(open_store(root).inventory(), root) if s.committed]
    assert listed == list(COMMITTED)


def test_a_failed_head_fails_the_listing_naming_the_manifest(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    """A manifest that cannot be checked is never taken for "not committed" (retention
    would then count one step fewer, and a load pick an older one)."""
    root = Location.parse(s3_bucket.root, s3_proxy.storage_options())
    fs = root.open_fs()
    _fill(fs, root, 1)
    s3_proxy.add(Rule("HeadObject", action="status", status=403))
    with pytest.raises(StoreError, match=MANIFEST_KEY):
        committed_steps(open_store(root))
    assert s3_proxy.count("HeadObject", faulted=True) >= 1


def test_only_objckpt_s_own_step_names_count(tmp_path: Any) -> None:
    """``step-00000000005`` (a step number with an extra leading zero, made by hand) is
    not step 5's directory: the manager would read and delete ``step-0000000005``."""
    root = Location.parse(f"file://{tmp_path}/root")
    fs = root.open_fs()
    _fill(fs, root, 1)
    fs.makedirs(f"{tmp_path}/root/step-00000000005", exist_ok=True)
    fs.pipe_file(f"{tmp_path}/root/step-00000000005/{MANIFEST_KEY}", b"{}")
    assert [s.step for s in committed_steps(open_store(root))] == list(COMMITTED)


def test_an_empty_or_missing_root_has_no_steps(tmp_path: Any) -> None:
    root = Location.parse(f"file://{tmp_path}/nothing-here")
    assert committed_steps(open_store(root)) == []


def test_a_missing_bucket_is_named(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> None:
    root = Location.parse("s3://no-such-bucket-objckpt/run", s3_proxy.storage_options())
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-objckpt"):
        committed_steps(open_store(root))


def test_gcs_root(fake_gcs_bucket: StoreTarget) -> None:
    root = Location.parse(fake_gcs_bucket.root, fake_gcs_bucket.storage_options)
    fs = root.open_fs()
    _fill(fs, root, 3)
    assert [s.step for s in committed_steps(open_store(root))] == list(COMMITTED)
