"""Security: secrets stay out of logs, errors and manifests; the load path never
unpickles; the manifest's object list is all the reader fetches."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, quiet, save

from objckpt import CheckpointManager, Location, ObjectStoreReader, ReadOptions, RetryPolicy
from objckpt.cli import main
from objckpt.errors import CheckpointNotFoundError, ManifestError, StateDictError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY, is_objckpt_payload
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget

KEY_ID = "AKIAOBJCKPTLEAKCHECK7"
SECRET = "objckpt/Leak+Check/Secret/Value/0123456789"
FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2, timeout=5)


def _state() -> dict:
    return {"w": torch.arange(64 * 1024, dtype=torch.float32), "meta": {"lr": 0.1}}


def test_no_secret_or_signature_in_logs_errors_or_manifests(
    moto_server: MotoServer, s3_bucket: StoreTarget, caplog, capfd
) -> None:
    caplog.set_level(logging.DEBUG, logger="objckpt")
    with FaultProxy(moto_server.endpoint_url, seed=3) as proxy:
        opts = {**proxy.storage_options(), "key": KEY_ID, "secret": SECRET}
        target = StoreTarget(root=s3_bucket.root, storage_options=opts)
        proxy.add(Rule(probability=0.2, action="status", status=503))  # retries get logged
        save(_state(), target.url("a"), target, retry=FAST)
        got = empty_like_state(_state())
        load(got, target.url("a"), target, retry=FAST)
        assert_state_equal(got, _state())
        assert any(s.fault for s in proxy.seen)  # retries really happened (and were logged)
        proxy.clear()
        # Failures: a commit that is refused, a checkpoint that is not there.
        messages = []
        for url in (target.url("a"), target.url("missing")):
            try:
                if url.endswith("/a"):
                    save(_state(), url, target, retry=FAST)
                else:
                    load(empty_like_state(_state()), url, target, retry=FAST)
            except BaseException as exc:
                err = carried(exc)
                messages += [str(err), repr(err), str(err.__cause__)]
        assert len(messages) == 6
        runner = CliRunner()
        flags = [f"--storage-option={k}={v}" for k, v in opts.items() if k != "client_kwargs"]
        cli = [
            runner.invoke(main, ["-vv", "info", target.url("a"), *flags]),
            runner.invoke(main, ["-vv", "verify", target.url("a"), *flags]),
            runner.invoke(main, ["-vv", "ls", target.url("nope-root"), *flags]),
        ]
    manifest = (
        moto_server.boto3_client()
        .get_object(Bucket=s3_bucket.bucket, Key=f"t/a/{MANIFEST_KEY}")["Body"]
        .read()
    )
    out, err = capfd.readouterr()
    seen = "\n".join(
        [caplog.text, out, err, manifest.decode(), *messages, *(r.output for r in cli)]
    )
    for needle in (SECRET, SECRET.replace("/", "%2F"), "X-Amz-Signature", "Signature="):
        assert needle not in seen, f"{needle!r} leaked"
    assert KEY_ID not in manifest.decode()


#: Distinctive credentials for the ``-vv`` runs: any trace of them in stderr is a leak.
VV_KEY_ID = "AKIAOBJCKPTVVLEAK042"
VV_SECRET = "objckpt-vv-secret-Value-0042"
VV_TOKEN = "FwoGZXIvYXdzEObjckptVvSessionToken0042"


def _cli_stderr(args: list[str], env: dict[str, str]) -> str:
    """stderr of the real ``objckpt`` command in a child process: the handler and
    filter it installs are the ones a user gets (in-process, pytest's own logging
    handlers would stand in for them)."""
    proc = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.parametrize("given", ["environment", "storage-option", "config-env"])
def test_vv_never_prints_signatures_key_ids_or_tokens(
    moto_server: MotoServer, s3_bucket: StoreTarget, given: str, tmp_path: Path
) -> None:
    """``-vv`` shows botocore's requests, whose ``Authorization`` header carries
    ``Credential=<access key id>/...`` and ``Signature=<hex>``, and whose signing
    records carry the session token: all of it must be cut before stderr, whether
    the credentials come from the environment or from ``--storage-option``."""
    save(_state(), s3_bucket.url("a"), s3_bucket)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_server.endpoint_url,
    }
    flags: list[str] = []
    if given == "environment":
        env |= {
            "AWS_ACCESS_KEY_ID": VV_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": VV_SECRET,
            "AWS_SESSION_TOKEN": VV_TOKEN,
        }
    elif given == "storage-option":
        for k, v in {"key": VV_KEY_ID, "secret": VV_SECRET, "token": VV_TOKEN}.items():
            flags += ["--storage-option", f"{k}={v}"]
    else:  # a config file naming the variables its secrets come from (storage.env)
        config = tmp_path / "run.toml"
        config.write_text(
            f'root = "{s3_bucket.root}"\n[storage]\n'
            'env = { key = "OBJCKPT_VV_KEY", secret = "OBJCKPT_VV_SECRET", '
            'token = "OBJCKPT_VV_TOKEN" }\n'
        )
        env |= {"OBJCKPT_VV_KEY": VV_KEY_ID, "OBJCKPT_VV_SECRET": VV_SECRET}
        env |= {"OBJCKPT_VV_TOKEN": VV_TOKEN}
        flags = ["--config", str(config)]
    group, flags = (flags, []) if given == "config-env" else ([], flags)
    seen = "\n".join(
        _cli_stderr(["-vv", *group, *args, *flags], env)
        for args in (["ls", s3_bucket.root], ["info", s3_bucket.url("a")])
    )
    # The requests really were logged, headers and all (else this proves nothing).
    assert "DEBUG botocore.endpoint: Sending http request" in seen
    for needle in (VV_KEY_ID, VV_SECRET, VV_TOKEN, "Signature=", "Credential=AKIA"):
        assert needle not in seen, f"{needle!r} leaked"
    assert "'Authorization': b'<redacted>'" in seen


@pytest.mark.parametrize(
    "line",
    [
        "GET https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={VV_KEY_ID}%2F20261128%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Signature=0123abcd&X-Amz-Security-Token=IQoJb3JpZ2luX2VjE",
        "headers: {'authorization': 'Bearer ya29.a0AfH6SMBsecret', 'x-goog-api-key': 'AIzaSy0'}",
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIA0000/20261128/us-east-1/s3/aws4_request",
    ],
    ids=["presigned-url", "bearer", "header-line"],
)
def test_the_cli_log_filter_cuts_other_credential_forms(line: str) -> None:
    from objckpt.cli.app import RedactingFilter

    record = logging.LogRecord("x", logging.DEBUG, __file__, 1, "%s", (line,), None)
    assert RedactingFilter().filter(record)
    out = record.getMessage()
    for needle in (VV_KEY_ID, "0123abcd", "IQoJb3JpZ2luX2VjE", "ya29", "AIzaSy0", "AKIA0000"):
        assert needle not in out, out
    assert "<redacted>" in out


def test_reader_fetches_only_what_the_manifest_names(
    moto_server: MotoServer, s3_bucket: StoreTarget
) -> None:
    """A crafted manifest naming ``../secret.bin`` is refused before any fetch."""
    with FaultProxy(moto_server.endpoint_url) as proxy:
        target = StoreTarget(root=s3_bucket.root, storage_options=proxy.storage_options())
        save(_state(), target.url("run/ck"), target)
        client = moto_server.boto3_client()
        client.put_object(Bucket=s3_bucket.bucket, Key="t/run/secret.bin", Body=b"private")
        key = f"t/run/ck/{MANIFEST_KEY}"
        doc = json.loads(client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read())
        doc["objects"][0]["key"] = "../secret.bin"
        client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=json.dumps(doc).encode())
        proxy.clear()
        with pytest.raises(ManifestError, match="escapes the checkpoint"):
            load(empty_like_state(_state()), target.url("run/ck"), target)
        fetched = [s.path for s in proxy.seen if s.operation == "GetObject"]
        assert fetched == [f"/objckpt-test/t/run/ck/{MANIFEST_KEY}"], fetched


class _Boom:
    """Unpickling this writes a marker file: proof that something unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path(self.marker).touch, ())


def test_load_never_unpickles_metadata_or_payload(tmp_path: Path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    save(_state(), target.url("ck"), target)
    marker = tmp_path / "pwned"
    # A poisoned .metadata: objckpt reads the manifest's JSON, never this pickle.
    (tmp_path / "ck" / METADATA_KEY).write_bytes(pickle.dumps(_Boom(str(marker))))
    got = empty_like_state(_state())
    load(got, target.url("ck"), target)
    assert_state_equal(got, _state())
    assert not marker.exists()
    # A poisoned payload (checksums off, so only weights_only stands in the way).
    payload = next(p for p in (tmp_path / "ck").iterdir() if is_objckpt_payload(p.name))
    size = payload.stat().st_size
    evil = pickle.dumps(_Boom(str(marker)))
    payload.write_bytes(evil + bytes(size - len(evil)))
    with pytest.raises(BaseException) as info:
        load(empty_like_state(_state()), target.url("ck"), target, read=ReadOptions(verify=False))
    err = carried(info.value)
    assert isinstance(err, StateDictError) and "never unpickles" in str(err), err
    assert "'meta.lr'" in str(err) and payload.name in str(err)
    assert not marker.exists()
    assert os.path.exists(Location.parse(target.url("ck")).key_path(MANIFEST_KEY))


def _stock_with_poisoned_metadata(directory: Path, marker: Path) -> None:
    """A directory that looks like a stock DCP checkpoint: a .metadata whose pickle
    would create ``marker`` when unpickled (and no manifest)."""
    directory.mkdir(parents=True)
    (directory / METADATA_KEY).write_bytes(pickle.dumps(_Boom(str(marker))))


def test_the_stock_path_refuses_a_pickle_that_names_other_classes(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _stock_with_poisoned_metadata(tmp_path / "ck", marker)
    with pytest.raises(ManifestError, match=r"names builtins\.getattr, which is not part of DCP"):
        ObjectStoreReader(f"file://{tmp_path}/ck")
    assert not marker.exists()


def test_the_manager_never_takes_the_stock_path(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with CheckpointManager(f"file://{tmp_path}/run") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).result(timeout=120)
    _stock_with_poisoned_metadata(tmp_path / "run" / step_name(7), marker)
    with CheckpointManager(f"file://{tmp_path}/run") as mgr:
        assert mgr.all_steps() == [1]  # a step exists only once committed
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.load({"w": torch.zeros(3)}, step=7)
    assert not marker.exists()


def test_a_real_stock_checkpoint_still_loads_through_the_allow_list(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2]), "lr": 0.1}
    with quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    got = {"w": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.int64), "lr": 0.0}
    reader = ObjectStoreReader(f"file://{tmp_path}/stock")
    assert reader.is_stock
    with quiet():
        dcp.load(got, storage_reader=reader)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert got["lr"] == 0.1
