"""Credentials against a moto server that enforces signatures and IAM policies.

The session's plain moto server accepts any key for anything, so these cases need
their own server started with ``iam=True``: an unknown access key, a wrong
secret, a read-only user, and a user that may write but not abort uploads. Each
must fail with an :class:`AccessDeniedError` that names the URL and the cause,
before anything is staged or uploaded, and must leave nothing in the bucket.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers import carried, fs_of, load, path_of, save

from objckpt import AsyncCheckpointer, CheckpointManager, Location
from objckpt.errors import AccessDeniedError
from objckpt.pipeline.stage import Stager
from objckpt.testing import GcsEmulator, MotoServer
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

READ_ONLY = ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"]
_buckets = itertools.count()


@pytest.fixture
def iam_server(moto_iam_server: MotoServer) -> MotoServer:
    return moto_iam_server


@pytest.fixture
def bucket(iam_server: MotoServer) -> StoreTarget:
    """A fresh bucket on the IAM server (it cannot be reset), with administrator options."""
    name = f"creds-{next(_buckets)}"
    iam_server.boto3_client().create_bucket(Bucket=name)
    return StoreTarget(
        root=f"s3://{name}/t", storage_options=iam_server.storage_options(), bucket=name
    )


@pytest.fixture
def staging_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts state-dict copies into staging memory (a spy; the real copy still runs)."""
    calls: list[int] = []
    real = Stager.stage

    def spy(self: Stager, state_dict: dict[str, Any]) -> Any:
        calls.append(1)
        return real(self, state_dict)

    monkeypatch.setattr(Stager, "stage", spy)
    return calls


def as_user(bucket: StoreTarget, options: dict[str, Any]) -> StoreTarget:
    return StoreTarget(root=bucket.root, storage_options=options, bucket=bucket.bucket)


def leftovers(server: MotoServer, bucket: StoreTarget) -> tuple[list[str], list[str]]:
    """Objects and open multipart uploads in the bucket."""
    client = server.boto3_client()
    objects = client.list_objects_v2(Bucket=bucket.bucket).get("Contents", [])
    uploads = client.list_multipart_uploads(Bucket=bucket.bucket).get("Uploads", [])
    return [o["Key"] for o in objects], [u["Key"] for u in uploads]


def async_refusal(options: dict[str, Any], state: dict[str, Any], url: str) -> AccessDeniedError:
    """The error of an AsyncCheckpointer's first save to ``url`` (it must be refused)."""
    checkpointer = AsyncCheckpointer(storage_options=options)
    try:
        with pytest.raises(AccessDeniedError) as info:
            checkpointer.save(state, url)
    finally:
        checkpointer.close()
    return info.value


def wrong_key(server: MotoServer) -> dict[str, Any]:
    return {**server.storage_options(), "key": "AKIAOBJCKPTUNKNOWN00"}


def wrong_secret(server: MotoServer) -> dict[str, Any]:
    return {**server.storage_options(), "secret": "not-the-secret-of-this-key"}


def test_read_only_user_fails_before_staging_and_can_still_load(
    iam_server: MotoServer, bucket: StoreTarget, staging_calls: list[int]
) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
    save(state, bucket.url("c1"), bucket)
    reader = as_user(bucket, iam_server.add_user("reader-1", READ_ONLY))
    before = leftovers(iam_server, bucket)

    # Async: the first save to a bucket waits for the write probe, so nothing is copied.
    message = str(async_refusal(reader.storage_options, state, bucket.url("c2")))
    assert bucket.url("c2") in message and "s3:PutObject" in message
    assert staging_calls == []

    # Sync DCP save: refused in planning, before write_data.
    with pytest.raises(BaseException) as sync_info:
        save(state, bucket.url("c3"), reader)
    err = carried(sync_info.value)
    assert isinstance(err, AccessDeniedError) and bucket.url("c3") in str(err)
    assert leftovers(iam_server, bucket) == before

    # Read-only credentials are what an evaluation job has: loading works.
    out = {"w": torch.zeros(4096), "step": 0}
    load(out, bucket.url("c1"), reader)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3


def test_manager_with_read_only_user(iam_server: MotoServer, bucket: StoreTarget) -> None:
    state = {"w": torch.randn(256)}
    with CheckpointManager(bucket.root, storage_options=bucket.storage_options) as writer:
        writer.save(1, state).result()
    reader = as_user(bucket, iam_server.add_user("reader-2", READ_ONLY))
    with CheckpointManager(reader.root, storage_options=reader.storage_options) as manager:
        with pytest.raises(AccessDeniedError, match=r"s3:PutObject") as info:
            manager.save(2, state)
        assert manager.step_url(2) in str(info.value)
        out = {"w": torch.zeros(256)}
        assert manager.load(out) == 1 and torch.equal(out["w"], state["w"])
        assert manager.all_steps() == [1]
    assert leftovers(iam_server, bucket)[1] == []


def test_user_that_cannot_abort_uploads_is_refused(
    iam_server: MotoServer, bucket: StoreTarget
) -> None:
    """A failed part is cleaned up by AbortMultipartUpload; without it a failed save
    would leave billed garbage, so the preflight refuses such credentials too."""
    options = iam_server.add_user("no-abort", ["s3:GetObject", "s3:ListBucket", "s3:PutObject"])
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(8)}, bucket.url("c1"), as_user(bucket, options))
    err = carried(info.value)
    assert isinstance(err, AccessDeniedError)
    assert "s3:AbortMultipartUpload" in str(err) and bucket.url("c1") in str(err)
    assert leftovers(iam_server, bucket)[0] == []


@pytest.mark.parametrize(
    ("make_options", "cause"),
    [
        (wrong_key, "does not know this access key id"),
        (wrong_secret, "secret key does not match"),
    ],
    ids=["unknown-key", "wrong-secret"],
)
def test_wrong_credentials_named_on_save_and_load(
    iam_server: MotoServer,
    bucket: StoreTarget,
    staging_calls: list[int],
    make_options: Any,
    cause: str,
) -> None:
    save({"w": torch.ones(8)}, bucket.url("c1"), bucket)
    options = make_options(iam_server)
    wrong = as_user(bucket, options)

    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(8)}, bucket.url("c2"), wrong)
    err = carried(info.value)
    assert isinstance(err, AccessDeniedError) and isinstance(err, PermissionError)
    assert "credentials rejected" in str(err) and cause in str(err)
    assert bucket.url("c2") in str(err)

    assert cause in str(async_refusal(options, {"w": torch.ones(8)}, bucket.url("c3")))
    assert staging_calls == []

    with pytest.raises(BaseException) as load_info:
        load({"w": torch.zeros(8)}, bucket.url("c1"), wrong)
    err = carried(load_info.value)
    assert isinstance(err, AccessDeniedError) and cause in str(err)
    assert bucket.url("c1") in str(err)
    # The secret never appears in what the user sees.
    assert options["secret"] not in str(err) and options["secret"] not in str(info.value)
    objects, uploads = leftovers(iam_server, bucket)
    assert uploads == [] and all(k.startswith("t/c1/") for k in objects)


def test_gcs_read_only_principal_fails_before_staging(
    gcs_emulator: GcsEmulator, gcs_bucket: StoreTarget, staging_calls: list[int]
) -> None:
    """GCS has no empty-upload probe that leaves nothing; its testIamPermissions says
    which of the permissions a save needs the caller lacks."""
    state = {"w": torch.arange(64, dtype=torch.float32)}
    save(state, gcs_bucket.url("c1"), gcs_bucket)
    reader = as_user(gcs_bucket, gcs_emulator.read_only_options())
    message = str(async_refusal(reader.storage_options, state, gcs_bucket.url("c2")))
    assert "storage.objects.create" in message and gcs_bucket.url("c2") in message
    assert "storage.objects.list" not in message.split("lack")[1].split("(")[0]
    assert staging_calls == []
    out = {"w": torch.zeros(64)}
    load(out, gcs_bucket.url("c1"), reader)
    assert torch.equal(out["w"], state["w"])
    assert not fs_of(gcs_bucket).exists(path_of(gcs_bucket, gcs_bucket.url("c2")))


def test_gcs_refused_write_is_access_denied(
    gcs_emulator: GcsEmulator, gcs_bucket: StoreTarget
) -> None:
    """Past the preflight (a writer whose rights were revoked mid-run), GCS's 403
    still reads as AccessDeniedError naming the object, not a generic store error."""
    store = open_store(Location.parse(gcs_bucket.url("c1"), gcs_emulator.read_only_options()))
    with pytest.raises(AccessDeniedError, match=r"c1/manifest.json"):
        store.create("manifest.json", b"{}")
