"""The TOML config file read by the manager and the CLI.

One file names where a run's checkpoints live and how to reach them, without
holding a secret: credentials are referenced by environment variable name (or
an AWS profile), never written inline; a key that looks like a secret, at any
depth of the options (``client_kwargs.aws_secret_access_key``), is an error that
names the key's path and never its value. Every table and key is checked, and a
mistake names the file and key.

Each table but ``[storage]`` and ``[gc]`` is one option value, one to one: the
table named in :data:`TABLES` takes every field of its class under the field's own
name (a backup's ``storage`` is its ``storage_options``, resolved as ``[storage]``
is), and nothing else; a test walks the classes' fields against this schema and the
configuration guide, so a field added to a class is a key of the file. TOML has no
None: a field whose value may be None is None when its key is left out.

Schema (every table optional except ``root``)::

    root = "s3://bucket/run-1"              # required: the manager's root URL
    reuse_unchanged = true                  # reference unchanged items of the last step

    [storage]                               # how to reach the root
    options = { endpoint_url = "https://s3.eu-west-1.amazonaws.com" }  # plain fsspec options
    env = { key = "AWS_ACCESS_KEY_ID", secret = "AWS_SECRET_ACCESS_KEY" }  # option <- env var
    profile = "training"                    # AWS profile (s3fs's ``profile`` option)

    [retention]                             # RetentionPolicy: the root's steps kept
    keep_last = 3                           # newest N committed steps
    keep_every = 1000                       # steps that are multiples of K
    keep_newer_than = 86400                 # seconds

    [upload]                                # UploadOptions: how a save writes
    part_size = 16777216                    # bytes per multipart part
    object_size = 67108864                  # target bytes of a payload object
    max_parts_in_flight = 8                 # parts uploading at once per rank
    prefix_entropy = 0                      # hex digits of hashed key prefix (0: off)
    persistent_prefixes = false             # those prefixes in front of the step
    deadline = 600                          # seconds for one save's requests
    preflight_timeout = 30                  # seconds to prove the bucket writable
    compression = "zstd"                    # or "bytegroup+zstd", "zstd:1", ...
    stock_metadata_max_ranks = 2048         # .metadata up to this world size

    [async]                                 # AsyncOptions: how async saves run
    workers = 1                             # upload processes per rank
    uploads_per_worker = 2                  # objects each uploads at once
    max_saves_in_flight = 1                 # saves uploading at once
    barrier_timeout = 600                   # seconds the commit waits for every rank
    staging_budget = 4294967296             # bytes of staging one save may hold
    share_replicated = true                 # replicas upload a share each
    background_staging = false              # copy into staging after save() returns
    staging_threads = 4                     # threads of the copy into staging
    staging_dir = "/dev/shm"                # where staging memory lives
    exit_timeout = 60                       # seconds the exit waits for saves

    [gc]                                    # ``objckpt gc``
    grace = 3600                            # seconds an unreferenced object is spared

    [retry]                                 # RetryPolicy: every store request
    attempts = 6                            # tries, the first included
    base_delay = 0.2                        # seconds, doubled per retry
    max_delay = 10                          # seconds, the cap
    timeout = 60                            # seconds per request
    request_deadline = 300                  # seconds per request with its retries
    give_up_after = 60                      # seconds one failure may keep repeating

    [local]                                 # LocalTier: commit on node-local disk first
    path = "/local_nvme/ckpt"               # this node's directory
    retention = { keep_last = 2 }           # local steps kept (a RetentionPolicy)
    promote_every = 5                       # every 5th local save goes to the root
    min_free_bytes = 0                      # room to leave on the local disk
    replicas = 2                            # each node's files also on 1 other node
    replica_jump = 1                        # node g's replica goes to node g + 1
    replication_timeout = 600               # seconds one step's replication may take

    [[backups]]                             # BackupTarget: copies of each committed step
    url = "gs://replica/run-1"
    storage = { env = { token = "GOOGLE_APPLICATION_CREDENTIALS" } }
    mode = "copy"                           # or "replicated": the bucket replicates itself
    retention = { keep_last = 10 }          # the target's own; default: the primary's
    replica_timeout = 900                   # "replicated": seconds to wait for a step
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from objckpt._removed import replacement
from objckpt.errors import ConfigurationError
from objckpt.ops.maintain.gc import DEFAULT_GRACE
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.run.backup import BackupTarget
from objckpt.ops.tier.tiers import LocalTier
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "RENAMED_KEYS",
    "TABLES",
    "BackupTarget",
    "Config",
    "keys_of",
    "load_config",
    "looks_like_credential",
    "parse_config",
]

# Option keys that carry credentials: they must come from the environment. A key is
# credential-like when it is ``key`` (s3fs's access key id) or contains one of these
# words, at any depth of ``options``: ``client_kwargs.aws_secret_access_key`` is a
# secret as much as ``secret`` is (s3fs hands ``client_kwargs`` to botocore as is).
_SECRET_NAMES = frozenset({"key"})
_SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "access_key",
    "account_key",
    "private_key",
    "api_key",
    "connection_string",
)
#: The tables that are option values, each the class it builds (see the module's
#: docstring): one table per class, one key per field.
TABLES: Mapping[str, type] = {
    "retention": RetentionPolicy,
    "upload": UploadOptions,
    "async": AsyncOptions,
    "retry": RetryPolicy,
    "local": LocalTier,
    "backups": BackupTarget,
}
#: The one key that is not its field's name: a backup's ``storage`` table becomes its
#: ``storage_options`` (read from the environment, as ``[storage]`` is).
RENAMED_KEYS: Mapping[tuple[type, str], str] = {(BackupTarget, "storage_options"): "storage"}
_TOP = {"root", "reuse_unchanged", "storage", "gc", *TABLES}
_STORAGE = {"options", "env", "profile"}


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated config file, with storage options resolved from the environment."""

    source: str
    root: str
    storage_options: Mapping[str, Any] = dataclasses.field(repr=False)
    retention: RetentionPolicy
    async_options: AsyncOptions
    gc_grace: float
    backups: tuple[BackupTarget, ...]
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    local: LocalTier | None = None
    reuse_unchanged: bool = True
    upload: UploadOptions | None = None  # None: the manager's default

    def manager_options(self) -> dict[str, Any]:
        """The ``CheckpointManager`` keywords this file sets (all but the root)."""
        return {
            "storage_options": self.storage_options,
            "retention": self.retention,
            "upload": self.upload,
            "async_options": self.async_options,
            "backups": self.backups,
            "retry": self.retry,
            "local": self.local,
            "reuse_unchanged": self.reuse_unchanged,
        }


def keys_of(cls: type) -> dict[str, str]:
    """The config keys of option class ``cls``: key -> the field it sets."""
    return {RENAMED_KEYS.get((cls, f.name), f.name): f.name for f in dataclasses.fields(cls)}


def _table(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigurationError(f"{source}: {where} must be a table, got {type(value).__name__}")
    return value


def _no_unknown(table: Mapping[str, Any], known: set[str], where: str, source: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigurationError(
            f"{source}: unknown key {where}{unknown[0]!r} (known: {', '.join(sorted(known))})"
        )


def looks_like_credential(name: str) -> bool:
    """Whether an option key names a credential (``secret``, ``aws_session_token``, ...)."""
    lowered = name.lower()
    return lowered in _SECRET_NAMES or any(word in lowered for word in _SECRET_WORDS)


def credentials_in(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Each credential-like key in ``value`` (nested tables and arrays included), as
    its dotted path and its value: the config refuses the first by its path (never
    its value), and the CLI hides every such value from its log lines."""
    if isinstance(value, dict):
        for name, inner in value.items():
            where = f"{path}.{name}" if path else str(name)
            if looks_like_credential(str(name)):
                yield where, inner
            else:
                yield from credentials_in(inner, where)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from credentials_in(inner, f"{path}[{i}]")


def _storage(value: Any, where: str, source: str, environ: Mapping[str, str]) -> dict[str, Any]:
    table = _table(value, where, source)
    _no_unknown(table, _STORAGE, f"{where}.", source)
    options = dict(_table(table.get("options", {}), f"{where}.options", source))
    secret = next((path for path, _ in credentials_in(options, f"{where}.options")), None)
    if secret is not None:
        raise ConfigurationError(
            f"{source}: {secret} looks like a credential; secrets never go in the config "
            f"file: name an environment variable in {where}.env instead (or use a profile)"
        )
    env = _table(table.get("env", {}), f"{where}.env", source)
    for name, var in env.items():
        if not isinstance(var, str) or not var:
            raise ConfigurationError(
                f"{source}: {where}.env.{name} must name an environment variable, got {var!r}"
            )
        if var not in environ:
            raise ConfigurationError(
                f"{source}: {where}.env.{name} reads environment variable {var}, which is not set"
            )
        options[name] = environ[var]
    if "profile" in table:
        profile = table["profile"]
        if not isinstance(profile, str) or not profile:
            raise ConfigurationError(f"{source}: {where}.profile must be a non-empty string")
        options["profile"] = profile
    return options


def _typed(cls: Any, table: Mapping[str, Any], where: str, source: str) -> Any:
    for name, value in table.items():
        instead = replacement(cls, name, value)
        if instead is not None:
            raise ConfigurationError(
                f"{source}: {where}.{name} is gone, the {cls.__name__} field is now "
                f"{instead} (see docs/changes.md)"
            )
    known = {f.name for f in dataclasses.fields(cls)}
    _no_unknown(table, known, f"{where}.", source)
    try:
        return cls(**table)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: [{where}] {exc}") from None


def parse_config(
    text: str, *, source: str = "<config>", environ: Mapping[str, str] | None = None
) -> Config:
    """Validate a config file's text.

    Raises:
        ConfigurationError: Not TOML, unknown key, wrong type, inline secret,
            missing environment variable; the message names ``source`` and the key.
    """
    environ = os.environ if environ is None else environ
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{source} is not valid TOML: {exc}") from None
    _no_unknown(data, _TOP, "", source)
    root = data.get("root")
    if not isinstance(root, str) or not root:
        raise ConfigurationError(f"{source}: root (the checkpoint root URL) is required")
    storage = _storage(data.get("storage", {}), "storage", source, environ)
    try:
        Location.parse(root, storage)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: root: {exc}") from None
    retention = _typed(
        RetentionPolicy, _table(data.get("retention", {}), "retention", source), "retention", source
    )
    async_options = _typed(
        AsyncOptions, _table(data.get("async", {}), "async", source), "async", source
    )
    upload = None
    if "upload" in data:
        upload = _typed(UploadOptions, _table(data["upload"], "upload", source), "upload", source)
    gc = _table(data.get("gc", {}), "gc", source)
    _no_unknown(gc, {"grace"}, "gc.", source)
    grace = gc.get("grace", DEFAULT_GRACE)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        raise ConfigurationError(f"{source}: gc.grace must be seconds >= 0, got {grace!r}")
    backups_raw = data.get("backups", [])
    if not isinstance(backups_raw, list):
        raise ConfigurationError(f"{source}: backups must be an array of tables ([[backups]])")
    backups = []
    for i, entry in enumerate(backups_raw):
        where = f"backups[{i}]"
        entry = _table(entry, where, source)
        keys = keys_of(BackupTarget)
        _no_unknown(entry, set(keys), f"{where}.", source)
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"{source}: {where}.url is required")
        opts = _storage(entry.get("storage", {}), f"{where}.storage", source, environ)
        policy = None
        if "retention" in entry:
            policy = _typed(
                RetentionPolicy,
                _table(entry["retention"], f"{where}.retention", source),
                f"{where}.retention",
                source,
            )
        extra = {keys[k]: entry[k] for k in entry if k not in ("url", "storage", "retention")}
        try:
            backups.append(BackupTarget(url, opts, retention=policy, **extra))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{source}: {where}: {exc}") from None
    retry = _typed(RetryPolicy, _table(data.get("retry", {}), "retry", source), "retry", source)
    reuse = data.get("reuse_unchanged", True)
    if not isinstance(reuse, bool):
        raise ConfigurationError(f"{source}: reuse_unchanged must be true or false, got {reuse!r}")
    local = None
    if "local" in data:
        table = _table(data["local"], "local", source)
        if not isinstance(table.get("path"), str) or not table["path"]:
            raise ConfigurationError(f"{source}: local.path (this node's directory) is required")
        if "retention" in table:
            table = {
                **table,
                "retention": _typed(
                    RetentionPolicy,
                    _table(table["retention"], "local.retention", source),
                    "local.retention",
                    source,
                ),
            }
        local = _typed(LocalTier, table, "local", source)
    return Config(
        local=local,
        upload=upload,
        retry=retry,
        source=source,
        root=root,
        storage_options=storage,
        retention=retention,
        async_options=async_options,
        gc_grace=float(grace),
        backups=tuple(backups),
        reuse_unchanged=reuse,
    )


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigurationError: The file is missing or invalid (named in the message).
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc.strerror}") from None
    return parse_config(text, source=path, environ=environ)
