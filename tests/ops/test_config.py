"""The TOML config file: schema, secrets by reference, clear errors."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import sys
import textwrap

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
from objckpt.ops.run import config as config_module
from objckpt.ops.run.backup import BackupTarget
from objckpt.ops.run.config import RENAMED_KEYS, TABLES, keys_of, parse_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

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
retention = { keep_last = 3 }
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
    assert cfg.local == LocalTier(
        "/local_nvme/ckpt", retention=RetentionPolicy(keep_last=3), promote_every=5
    )
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
        ('root = "s3://b/r"\n[local]\npromote_every = 2', r"local\.path .* is required"),
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


# -- the tables mirror the option values (#45 item 5) ----------------------------------------

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "configuration.md"
#: The tables that are no option value, and why: ``[storage]`` is the manager's
#: ``storage_options`` (resolved from the environment), ``[gc]`` the CLI's ``gc``.
NOT_OPTIONS = {"storage", "gc"}
#: Inside a table, the keys that are option values of their own.
NESTED = {(LocalTier, "retention"): RetentionPolicy, (BackupTarget, "retention"): RetentionPolicy}


def _schema() -> str:
    """The module docstring's schema, as the TOML it is."""
    return textwrap.dedent((config_module.__doc__ or "").split("::\n", 1)[1])


def _docs_toml() -> dict:
    """Every ``toml`` block of the configuration guide, merged."""
    merged: dict = {}
    for block in re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S):
        merged.update(tomllib.loads(block))
    return merged


def _tables(data: dict) -> dict[str, dict]:
    """Each option table of a parsed file (a backup array: its first entry)."""
    return {
        name: (value[0] if isinstance(value, list) else value)
        for name, value in data.items()
        if isinstance(value, (dict, list))
    }


@pytest.mark.parametrize("where", ["objckpt/ops/run/config.py", "docs/guides/configuration.md"])
def test_each_table_lists_every_field_of_its_option_value(where: str) -> None:
    """Table name <-> options class, key <-> field, both ways: a field added to a class
    (or a key the class lacks) fails here until the schema and the guide say it."""
    data = tomllib.loads(_schema()) if where.endswith(".py") else _docs_toml()
    tables = _tables(data)
    assert set(tables) - NOT_OPTIONS == set(TABLES), where
    for name, cls in TABLES.items():
        fields = {RENAMED_KEYS.get((cls, f.name), f.name) for f in dataclasses.fields(cls)}
        assert set(tables[name]) == fields, f"{where} [{name}] vs {cls.__name__}'s fields"
        for (owner, key), inner in NESTED.items():
            if owner is cls:
                sub = {f.name for f in dataclasses.fields(inner)}
                assert set(tables[name][key]) <= sub, f"{where} [{name}].{key}"


def test_the_schema_parses_to_its_values_field_by_field(tmp_path, monkeypatch) -> None:
    """Every key of the schema reaches its field with the value written: what the file
    documents is what it accepts."""
    from objckpt.format import compress

    monkeypatch.setattr(compress, "zstd_available", lambda: True)  # parsing only
    text = _schema().replace('"/dev/shm"', f'"{tmp_path}"')
    environ = {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "GOOGLE_APPLICATION_CREDENTIALS": "t",
    }
    cfg = parse_config(text, environ=environ)
    built = {
        "retention": cfg.retention,
        "upload": cfg.upload,
        "async": cfg.async_options,
        "retry": cfg.retry,
        "local": cfg.local,
        "backups": cfg.backups[0],
    }
    assert set(built) == set(TABLES)
    for name, table in _tables(tomllib.loads(text)).items():
        if name in NOT_OPTIONS:
            continue
        cls = TABLES[name]
        for key, field in keys_of(cls).items():
            value = getattr(built[name], field)
            if (cls, field) in RENAMED_KEYS:  # storage -> storage_options, from the env
                assert value == {"token": "t"}
            elif (cls, key) in NESTED:
                assert value == NESTED[cls, key](**table[key]), (name, key)
            else:
                assert value == table[key], (name, key)


def test_the_manager_takes_every_value_the_file_sets() -> None:
    """The file holds the manager's options, all of them but the root and the group."""
    cfg = parse_config('root = "file:///tmp/x"', environ={})
    manager = set(inspect.signature(CheckpointManager).parameters) - {"root_url", "process_group"}
    assert set(cfg.manager_options()) == manager


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[async]\nmax_in_flight = 2", r"async\.max_in_flight is gone.* max_saves_in_flight=2"),
        ("[upload]\nmax_in_flight = 4", r"upload\.max_in_flight is gone.* max_parts_in_flight=4"),
        (
            '[local]\npath = "/x"\nkeep_last = 2',
            r"local\.keep_last is gone.*retention=objckpt\.RetentionPolicy\(keep_last=2\)",
        ),
    ],
)
def test_a_renamed_key_names_its_new_spelling(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_config(f'root = "file:///tmp/x"\n{text}', source="run.toml", environ={})
