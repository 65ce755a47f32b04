"""The TOML config file: schema, secrets by reference, clear errors."""

from __future__ import annotations

import pytest

from objckpt import (
    AsyncOptions,
    CheckpointManager,
    LocalTier,
    RetentionPolicy,
    RetryPolicy,
    load_config,
)
from objckpt.errors import ConfigurationError
from objckpt.ops.config import parse_config

GOOD = """
root = "s3://bucket/run-1"

[storage]
options = { endpoint_url = "http://localhost:9000", client_kwargs = { region_name = "eu-west-1" } }
env = { key = "MY_KEY_VAR", secret = "MY_SECRET_VAR" }
profile = "training"

[retention]
keep_last = 3
keep_every = 1000

[async]
workers = 3
staging_budget = 1073741824

[gc]
grace = 600

[local]
path = "/local_nvme/ckpt"
keep_last = 3
promote_every = 5

[retry]
attempts = 3
timeout = 20

[[backups]]
url = "file:///backups/run-1"

[[backups]]
url = "gs://replica/run-1"
storage = { env = { token = "GCS_TOKEN" } }
mode = "replicated"
replica_timeout = 120

[backups.retention]
keep_last = 10
"""

ENV = {"MY_KEY_VAR": "AKIA-TEST", "MY_SECRET_VAR": "s3cr3t", "GCS_TOKEN": "anon"}


def test_a_full_config_parses(tmp_path) -> None:
    path = tmp_path / "objckpt.toml"
    path.write_text(GOOD)
    cfg = load_config(path, environ=ENV)
    assert cfg.root == "s3://bucket/run-1"
    assert cfg.storage_options == {
        "endpoint_url": "http://localhost:9000",
        "client_kwargs": {"region_name": "eu-west-1"},
        "key": "AKIA-TEST",
        "secret": "s3cr3t",
        "profile": "training",
    }
    assert cfg.retention == RetentionPolicy(keep_last=3, keep_every=1000)
    assert cfg.async_options == AsyncOptions(workers=3, staging_budget=1 << 30)
    assert cfg.gc_grace == 600
    assert cfg.retry == RetryPolicy(attempts=3, timeout=20)
    assert cfg.local == LocalTier("/local_nvme/ckpt", keep_last=3, promote_every=5)
    assert [b.url for b in cfg.backups] == ["file:///backups/run-1", "gs://replica/run-1"]
    assert cfg.backups[1].storage_options == {"token": "anon"}
    assert cfg.backups[0].mode == "copy" and cfg.backups[0].retention is None
    assert cfg.backups[1].mode == "replicated" and cfg.backups[1].replica_timeout == 120
    assert cfg.backups[1].retention == RetentionPolicy(keep_last=10)
    assert "s3cr3t" not in repr(cfg)  # secrets stay out of reprs and logs


def test_only_root_is_required() -> None:
    cfg = parse_config('root = "file:///tmp/x"', environ={})
    assert cfg.retention.keeps_everything and cfg.backups == () and cfg.gc_grace == 3600
    assert cfg.local is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("root = ", "is not valid TOML"),
        ("[retention]\nkeep_last = 3", "root .* is required"),
        ('root = "s3://b/r"\nroot_url = "x"', "unknown key 'root_url'"),
        ('root = "s3://b/r"\n[retention]\nkeep_lst = 3', r"unknown key retention\.'keep_lst'"),
        ('root = "s3://b/r"\n[retention]\nkeep_last = 0', r"\[retention\] option keep_last="),
        ('root = "s3://b/r"\n[async]\nworkers = "two"', r"\[async\] option workers="),
        (
            'root = "s3://b/r"\n[storage]\noptions = { secret = "x" }',
            "storage.options.secret looks",
        ),
        ('root = "s3://b/r"\n[storage]\nenv = { key = "NOPE_UNSET" }', "NOPE_UNSET, which is not"),
        ('root = "nope://b/r"', "unknown protocol 'nope'"),
        ('root = "s3://b/r"\n[gc]\ngrace = -1', "gc.grace must be"),
        ('root = "s3://b/r"\n[retry]\nattempts = 0', r"\[retry\] option attempts="),
        ('root = "s3://b/r"\n[[backups]]\nstorage = {}', r"backups\[0\]\.url is required"),
        ('root = "s3://b/r"\nbackups = "x"', "backups must be an array"),
        (
            'root = "s3://b/r"\n[[backups]]\nurl = "s3://c/r"\nmode = "mirror"',
            r"backups\[0\]: backup s3://c/r: mode='mirror' is invalid",
        ),
        (
            'root = "s3://b/r"\n[[backups]]\nurl = "s3://c/r"\nretention = { keep_last = 0 }',
            r"\[backups\[0\]\.retention\] option keep_last=",
        ),
        ('root = "s3://b/r"\n[[backups]]\nurl = "s3://c/r"\nkeep = 1', r"backups\[0\]\.'keep'"),
        ('root = "s3://b/r"\n[local]\nkeep_last = 2', r"local\.path .* is required"),
        ('root = "s3://b/r"\n[local]\npath = "/x"\npromote = 2', r"unknown key local\.'promote'"),
        (
            'root = "s3://b/r"\n[local]\npath = "s3://c/x"',
            r"\[local\] LocalTier path s3://c/x is not a local directory",
        ),
    ],
)
def test_mistakes_name_the_file_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        parse_config(text, source="run.toml", environ={})
    assert str(info.value).startswith("run.toml")


def test_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot read config file .*nope\.toml"):
        load_config(tmp_path / "nope.toml")


#: Values no message may contain: each test below checks the error names the key only.
_SECRET_VALUE = "wJalrXUtnFEMI-config-secret-value"
_KEY_VALUE = "AKIACONFIGNESTED0001"


@pytest.mark.parametrize(
    ("options", "path"),
    [
        (
            f'{{ client_kwargs = {{ aws_secret_access_key = "{_SECRET_VALUE}", '
            f'aws_access_key_id = "{_KEY_VALUE}" }} }}',
            "storage.options.client_kwargs.aws_secret_access_key",
        ),
        (
            f'{{ client_kwargs = {{ region_name = "x", aws_access_key_id = "{_KEY_VALUE}" }} }}',
            "storage.options.client_kwargs.aws_access_key_id",
        ),
        (
            "{ config_kwargs = { proxies_config = { "
            f'proxy_password = "{_SECRET_VALUE}" }} }} }}',
            "storage.options.config_kwargs.proxies_config.proxy_password",
        ),
        (
            "{ session_kwargs = { headers = [{ x = 1 }, "
            f'{{ api_key = "{_SECRET_VALUE}" }}] }} }}',
            r"storage.options.session_kwargs.headers[1].api_key",
        ),
        (f'{{ AWS_SESSION_TOKEN = "{_SECRET_VALUE}" }}', "storage.options.AWS_SESSION_TOKEN"),
    ],
    ids=["secret-in-client-kwargs", "key-id-in-client-kwargs", "deeper", "in-array", "case"],
)
def test_a_nested_credential_is_refused_naming_its_path_not_its_value(
    options: str, path: str
) -> None:
    """A credential one table down is as much inline as one at the top: s3fs hands
    ``client_kwargs`` to botocore, which signs with ``aws_secret_access_key``."""
    text = f'root = "s3://b/r"\n[storage]\noptions = {options}\n'
    with pytest.raises(ConfigurationError) as info:
        parse_config(text, source="run.toml", environ={})
    message = str(info.value)
    assert message.startswith(f"run.toml: {path} looks like a credential"), message
    assert _SECRET_VALUE not in message and _KEY_VALUE not in message


def test_a_nested_credential_in_a_backup_is_refused_by_from_config(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'root = "file:///tmp/run"\n[[backups]]\nurl = "s3://c/r"\n'
        "storage = { options = { client_kwargs = { "
        f'aws_secret_access_key = "{_SECRET_VALUE}" }} }} }}\n'
    )
    with pytest.raises(ConfigurationError) as info:
        CheckpointManager.from_config(path)
    message = str(info.value)
    assert "backups[0].storage.options.client_kwargs.aws_secret_access_key" in message
    assert _SECRET_VALUE not in message


def test_nested_options_without_credentials_still_pass() -> None:
    cfg = parse_config(
        'root = "s3://b/r"\n[storage]\n'
        'options = { client_kwargs = { region_name = "eu-west-1" }, '
        "config_kwargs = { retries = { max_attempts = 2 } } }\n",
        environ={},
    )
    assert cfg.storage_options["client_kwargs"] == {"region_name": "eu-west-1"}
