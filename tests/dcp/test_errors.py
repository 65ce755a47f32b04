"""Bad input: each gets a clear error naming the culprit, in bounded time, before any commit."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch
from helpers import carried, fs_of, path_of, save

from objckpt import CheckpointManager, ObjectStoreReader, ObjectStoreWriter, UploadOptions
from objckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigurationError,
    ManifestError,
    MissingCredentialsError,
    StateDictError,
    StoreUnreachableError,
)
from objckpt.testing import MotoServer, free_port
from objckpt.testing.plugin import StoreTarget


def test_unknown_protocol_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown protocol 'nosuch'.*nosuch://b/c"):
        ObjectStoreWriter("nosuch://b/c")
    with pytest.raises(ConfigurationError, match="unknown protocol"):
        ObjectStoreReader("nosuch://b/c")


def test_bad_writer_options_named() -> None:
    with pytest.raises(ConfigurationError, match="overwrite"):
        ObjectStoreWriter("memory://b/c", overwrite="yes")  # type: ignore[arg-type]


def test_missing_s3_bucket(moto_server: MotoServer) -> None:
    target = StoreTarget(
        root="s3://no-such-bucket/x", storage_options=moto_server.storage_options()
    )
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target)
    err = carried(info.value)
    assert isinstance(err, BucketNotFoundError) and isinstance(err, FileNotFoundError)
    assert "no-such-bucket" in str(err)


def test_missing_gcs_bucket(gcs_bucket: StoreTarget) -> None:
    target = StoreTarget(root="gs://no-such-bucket/x", storage_options=gcs_bucket.storage_options)
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target)
    err = carried(info.value)
    assert isinstance(err, BucketNotFoundError) and "no-such-bucket" in str(err)


def test_local_root_under_a_file(tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    target = StoreTarget(root=f"file://{tmp_path}/afile/ck", storage_options={})
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target)
    assert isinstance(carried(info.value), BucketNotFoundError)


@pytest.mark.timeout(60)
def test_refused_endpoint_is_unreachable_in_bounded_time() -> None:
    opts = {
        "endpoint_url": f"http://127.0.0.1:{free_port()}",
        "key": "k",
        "secret": "SECRET-VALUE-1",
    }
    target = StoreTarget(root="s3://bucket/x", storage_options=opts)
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target, upload=UploadOptions(preflight_timeout=20))
    err = carried(info.value)
    assert isinstance(err, StoreUnreachableError) and "s3://bucket/x" in str(err)
    assert "SECRET-VALUE-1" not in str(err)


@pytest.mark.timeout(60)
def test_silent_endpoint_times_out(black_hole: str) -> None:
    target = StoreTarget(
        root="s3://bucket/x",
        storage_options={"endpoint_url": black_hole, "key": "k", "secret": "s"},
    )
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target, upload=UploadOptions(preflight_timeout=2))
    err = carried(info.value)
    assert isinstance(err, StoreUnreachableError) and "no answer within 2" in str(err)


def test_missing_credentials(
    moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    target = StoreTarget(
        root="s3://bucket/x", storage_options={"endpoint_url": moto_server.endpoint_url}
    )
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(3)}, target.root, target, upload=UploadOptions(preflight_timeout=20))
    err = carried(info.value)
    assert isinstance(err, MissingCredentialsError) and "s3://bucket/x" in str(err)


def test_unserializable_entry_fails_before_upload(store: StoreTarget) -> None:
    url = store.url("c1")
    state = {"w": torch.ones(1000), "lock": threading.Lock()}
    with pytest.raises(BaseException) as info:
        save(state, url, store)
    err = carried(info.value)
    assert isinstance(err, StateDictError) and "'lock'" in str(err)
    fs = fs_of(store)
    path = path_of(store, url)
    leftovers = fs.ls(path, detail=False) if fs.exists(path) else []
    assert leftovers == [], "nothing may be written for a state dict that cannot be saved"


@pytest.mark.parametrize(
    "bad",
    [torch.eye(3).to_sparse(), torch.empty(3, device="meta")],
    ids=["sparse", "meta"],
)
def test_a_tensor_no_payload_can_hold_is_named_before_upload(
    store: StoreTarget, bad: torch.Tensor
) -> None:
    """A sync save of a sparse or meta tensor fails with StateDictError naming its
    key (as the async path does), before any object is written."""
    url = store.url("c1")
    with pytest.raises(BaseException) as info:
        save({"w": torch.ones(1000), "opt": {"bad": bad}}, url, store)
    err = carried(info.value)
    assert isinstance(err, StateDictError) and "'opt.bad'" in str(err), err
    fs = fs_of(store)
    path = path_of(store, url)
    assert (fs.ls(path, detail=False) if fs.exists(path) else []) == []


def test_gcs_refusals_translate_to_access_denied() -> None:
    """gcsfs raises a bare OSError("Forbidden: ...") for 403 and HttpError(code=401) for
    rejected credentials; both must read as AccessDeniedError naming the URL."""
    from gcsfs.retry import HttpError

    from objckpt.writers.translate import translate

    forbidden = translate(
        OSError("Forbidden: b/o\nno storage.objects.create access"),
        url="gs://b/o",
        action="committing",
    )
    assert isinstance(forbidden, AccessDeniedError) and "gs://b/o" in str(forbidden)
    rejected = translate(
        HttpError({"code": 401, "message": "Invalid Credentials"}), url="gs://b/o", action="reading"
    )
    assert isinstance(rejected, AccessDeniedError)
    assert "credentials rejected" in str(rejected) and "gs://b/o" in str(rejected)


def _newer_manifest(doc: dict) -> dict:
    from objckpt.format.manifest import SPREAD_VERSION  # the newest this objckpt reads

    return {**doc, "version": SPREAD_VERSION + 1}


def _schema_broken_manifest(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "attempt"}


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda raw: b"<html>not json</html>", "not valid JSON"),
        (lambda raw: json.dumps(_newer_manifest(json.loads(raw))).encode(), "newer than"),
        (lambda raw: json.dumps(_schema_broken_manifest(json.loads(raw))).encode(), "'attempt'"),
    ],
    ids=["not-json", "newer-version", "schema"],
)
def test_bad_manifest_on_the_store_is_named(
    moto_server: MotoServer, s3_bucket: StoreTarget, damage: Any, needle: str
) -> None:
    """A manifest replaced on the store (by hand, by a newer objckpt, by a broken tool)
    is refused by the reader and by the manager, naming the manifest's URL."""
    with CheckpointManager(s3_bucket.root, storage_options=s3_bucket.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(16)}).result()
        url = mgr.step_url(1)
    key = f"{path_of(s3_bucket, url).split('/', 1)[1]}/manifest.json"
    client = moto_server.boto3_client()
    raw = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=damage(raw))

    with pytest.raises(ManifestError, match=needle) as info:
        ObjectStoreReader(url, storage_options=s3_bucket.storage_options)
    assert f"{url}/manifest.json" in str(info.value)
    with (
        CheckpointManager(s3_bucket.root, storage_options=s3_bucket.storage_options) as mgr,
        pytest.raises(ManifestError, match=needle),
    ):
        mgr.load({"w": torch.zeros(16)}, step=1)


def test_an_async_save_names_a_meta_tensor_before_upload(s3_bucket: StoreTarget) -> None:
    import objckpt

    url = s3_bucket.url("c1")
    state = {"w": torch.ones(8), "model": {"lazy": torch.empty(4, device="meta")}}
    with pytest.raises(StateDictError, match=r"'model\.lazy'.*meta tensor"):
        objckpt.async_save(state, url, storage_options=s3_bucket.storage_options)
    fs = fs_of(s3_bucket)
    path = path_of(s3_bucket, url)
    assert (fs.ls(path, detail=False) if fs.exists(path) else []) == []


def test_the_tree_in_the_errors_docstring_lists_exactly_the_classes() -> None:
    """The hierarchy drawn in objckpt.errors' docstring is the hierarchy: every
    exported error class appears in it once, under its real parent."""
    import re

    import objckpt.errors as errors

    drawn: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^\s*((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+Error)\b", line)
        if not m or ("──" not in line and m.group(2) != "ObjckptError"):
            continue
        depth = len(m.group(1)) // 4 + (1 if "──" in line else 0)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        assert m.group(2) not in drawn, f"{m.group(2)} drawn twice"
        drawn[m.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(2)))
    classes = {
        name: getattr(errors, name)
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
    }
    assert set(drawn) == set(classes), set(classes) ^ set(drawn)
    for name, parent in drawn.items():
        if parent is not None:
            assert classes[parent] in classes[name].__bases__, (name, parent)
