"""Where a checkpoint lives: a URL, its fsspec protocol, and how to open it.

A :class:`Location` is a picklable value (URL plus ``storage_options``) from which
any process can build its own filesystem object. Filesystem objects themselves are
never shared across processes: s3fs and gcsfs hold event loops and sockets that
are not fork-safe, so every worker opens a fresh one with
``skip_instance_cache=True``.

``storage_options`` are handed to fsspec untouched. They often hold credentials,
so they are kept out of ``repr`` and never formatted into messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem

from objckpt.errors import ConfigurationError
from objckpt.writers.retry import RetryPolicy, s3_options

__all__ = [
    "STEP_DIR",
    "Location",
    "backend_options",
    "is_spread_dir",
    "is_spread_key",
    "placed",
    "spread_dir",
    "unplaced",
]

#: A root's step directory name: ``step-`` and 10 or more ASCII digits, the whole
#: name (``re.fullmatch``: no trailing newline).
STEP_DIR = re.compile(r"step-[0-9]{10,}")
_SPREAD_DIR = re.compile(r"spread-[0-9a-f]{1,8}")

# The optional dependency each well-known protocol needs, for a helpful ImportError.
_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}
_LOCAL = ("file", "local")
_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")
_AZURE = ("az", "abfs", "abfss")


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint URL and the options to open its store.

    Attributes:
        url: The URL as the caller wrote it, normalised (no trailing slash).
        protocol: fsspec's protocol name (``s3``, ``gs``, ``file``, ``memory``, ...).
        path: The URL in fsspec's protocol-less form (``bucket/prefix`` for object
            stores, an absolute path for ``file``).
        storage_options: Passed to ``fsspec.filesystem`` (for S3, with the SDKs'
            own retries off unless set: ``retry`` governs).
        retry: How requests to the store are retried (:mod:`objckpt.writers.retry`).
    """

    url: str
    protocol: str
    path: str
    storage_options: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, hash=False
    )
    retry: RetryPolicy = dataclasses.field(
        default_factory=RetryPolicy, repr=False, compare=False, hash=False
    )

    @classmethod
    def parse(
        cls,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Location:
        """Validate ``url`` and split it into protocol and path.

        Raises:
            ConfigurationError: The URL is empty, has no bucket, or names a protocol
                fsspec does not know.
        """
        if isinstance(url, os.PathLike):
            url = os.fspath(url)
        if not isinstance(url, str) or not url.strip():
            raise ConfigurationError(f"checkpoint URL must be a non-empty string, got {url!r}")
        url = url.strip()
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigurationError(
                f"storage_options for {url} must be a mapping, got {type(storage_options).__name__}"
            )
        protocol, sep, _ = url.partition("://")
        if not sep:
            protocol, url = "file", "file://" + os.path.abspath(url)
        protocol = protocol.lower()
        if protocol not in fsspec.available_protocols():
            raise ConfigurationError(
                f"unknown protocol {protocol!r} in checkpoint URL {url}; "
                f"fsspec knows e.g. s3://, gs://, file://, memory://"
            )
        parts = urlsplit(url)
        if parts.query or parts.fragment:
            raise ConfigurationError(f"checkpoint URL {url} must not carry a query or fragment")
        if protocol in _LOCAL:
            path = os.path.abspath(url.partition("://")[2] or "/")
        else:
            path = url.partition("://")[2].strip("/")
            if not path:
                raise ConfigurationError(f"checkpoint URL {url} names no bucket or path")
            if protocol not in ("memory",) and "/" not in path:
                raise ConfigurationError(
                    f"checkpoint URL {url} names only a bucket; "
                    f"give a prefix, e.g. {url.rstrip('/')}/ckpt"
                )
        norm = f"{protocol}://{path}" if protocol not in _LOCAL else f"file://{path}"
        if protocol == "memory":
            path = "/" + path
        return cls(
            url=norm.rstrip("/"),
            protocol=protocol,
            path=path.rstrip("/") or "/",
            storage_options=dict(storage_options or {}),
            retry=retry or RetryPolicy(),
        )

    @classmethod
    def is_valid(cls, url: str | os.PathLike[str]) -> bool:
        """Whether ``url`` parses (DCP's ``validate_checkpoint_id`` hook)."""
        try:
            cls.parse(url)
        except ConfigurationError:
            return False
        return True

    @property
    def is_local(self) -> bool:
        return self.protocol in _LOCAL

    @property
    def has_bucket(self) -> bool:
        """Whether the first path segment is a bucket (or container): object stores,
        not a filesystem or ``memory://``."""
        return not self.is_local and self.protocol != "memory"

    @property
    def bucket(self) -> str:
        """The first path segment: the bucket on object stores."""
        return self.path.lstrip("/").split("/", 1)[0]

    def child(self, name: str) -> Location:
        """The location of a sub-prefix (used for ``step-N`` directories)."""
        name = name.strip("/")
        return dataclasses.replace(self, url=f"{self.url}/{name}", path=f"{self.path}/{name}")

    def parent(self) -> Location:
        """The location one level up (the directory of a file, the root of a step)."""
        url, path = self.url.rstrip("/"), self.path.rstrip("/")
        return dataclasses.replace(self, url=url.rsplit("/", 1)[0], path=path.rsplit("/", 1)[0])

    def key_path(self, key: str) -> str:
        """fsspec path of an object named by a key relative to this location.

        A key that starts with one ``../`` (a reference to a sibling step's object,
        validated by :func:`objckpt.format.refs.split_reference` wherever keys are
        read) is resolved here: object stores do not resolve ``..`` in a path. So is
        a spread key of a step directory (``spread-3f/<name>``, :func:`placed`):
        it is stored under the root, in front of the step's name.
        """
        return _resolve(self.path, key)

    def url_of(self, key: str) -> str:
        """Full URL of an object, for messages."""
        return _resolve(self.url, key)

    def listing_root(self, key: str) -> Location:
        """The directory whose (recursive) listing shows the object ``key`` names:
        this location for its own keys, the sibling step's for a reference, the
        step's share of a spread directory for a spread key (:func:`placed`)."""
        url = self.url.rstrip("/")
        own_spread = is_spread_key(key) and STEP_DIR.fullmatch(url.rsplit("/", 1)[-1])
        if not key.startswith("../") and not own_spread:
            return self
        parent = self.parent()
        parts = _resolve(url, key)[len(parent.url.rstrip("/")) + 1 :].split("/")
        return parent.child("/".join(parts[: 2 if is_spread_dir(parts[0]) else 1]))

    def open_fs(
        self, *, fresh: bool = False, loop: asyncio.AbstractEventLoop | None = None
    ) -> AbstractFileSystem:
        """Build the fsspec filesystem for this location.

        Args:
            fresh: Skip fsspec's instance cache. Required in a forked or spawned
                worker, where a cached async filesystem from the parent is unusable.
            loop: The event loop (running on a thread of its own) an async filesystem
                sends its requests from, unless ``storage_options`` name one; None:
                fsspec's process-wide IO loop. Its owner ends it
                (:class:`~objckpt.writers.clients.OwnedClients`).

        Raises:
            ConfigurationError: The backend package is missing or rejects the options.
        """
        options = dict(self.storage_options)
        if self.protocol in _S3:
            options = s3_options(options, self.retry)
        if fresh:
            options["skip_instance_cache"] = True
        try:
            if self.protocol in _S3:
                from objckpt.writers.s3client import RetryingS3FileSystem

                cls: type[AbstractFileSystem] = RetryingS3FileSystem
                ours = {"retry_policy": self.retry}
            elif self.protocol in _GCS:
                from objckpt.writers.gcsclient import RetryingGCSFileSystem

                cls = RetryingGCSFileSystem
                ours = {"retry_policy": self.retry}
            elif self.protocol in _AZURE:
                from objckpt.writers.azureclient import RetryingAzureBlobFileSystem

                cls = RetryingAzureBlobFileSystem
                ours = {"retry_policy": self.retry}
            else:
                cls, ours = fsspec.get_filesystem_class(self.protocol), {}
            if loop is not None and issubclass(cls, AsyncFileSystem):
                options.setdefault("loop", loop)
            fs = cls(**ours, **options)
        except ImportError as exc:
            extra = _EXTRAS.get(self.protocol)
            hint = f"pip install 'objckpt[{extra}]'" if extra else "install its fsspec backend"
            raise ConfigurationError(
                f"{self.protocol}:// needs an optional dependency that is not installed ({hint})"
            ) from exc
        except ValueError as exc:
            if self.protocol not in _AZURE:
                raise
            # adlfs: no connection string, account name or credential to connect with.
            raise ConfigurationError(
                f"{self.protocol}:// needs an account for {self.url}: set "
                "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with a key, "
                "SAS token or Azure AD credential (or the same in storage_options)"
            ) from exc
        except TypeError as exc:
            names = ", ".join(sorted(self.storage_options)) or "none"
            raise ConfigurationError(
                f"the {self.protocol}:// backend rejected storage_options for {self.url} "
                f"(option names given: {names}): {type(exc).__name__}"
            ) from exc
        return fs


def is_spread_dir(name: str) -> bool:
    """Whether a name is a spread directory (``spread-`` and 1-8 hex digits)."""
    return bool(_SPREAD_DIR.fullmatch(name.rstrip("/")))


def spread_dir(digits: str) -> str:
    """The spread directory of a payload's hashed prefix ``digits``."""
    return f"spread-{digits}"


def is_spread_key(key: str) -> bool:
    """A step's own spread key: ``spread-<hex>/<name>``, exactly two segments."""
    head, sep, name = key.partition("/")
    return bool(sep) and "/" not in name and bool(name) and is_spread_dir(head)


def placed(step_dir: str, key: str) -> str:
    """Where the object ``key`` of step directory ``step_dir`` is stored, relative to
    the root: ``<step_dir>/<key>``, except a spread key (``spread-3f/<name>``),
    which goes in front of the step (``spread-3f/<step_dir>/<name>``).

    Why in front: S3 partitions a bucket by key ranges, split where the load is. A
    new step's keys all sort after the last step's, so under ``<step_dir>/`` every
    save starts again in one range; under ``spread-3f/`` the ranges split by earlier
    steps hold the next step's keys too (``docs/guides/at-scale.md``)."""
    if is_spread_key(key) and STEP_DIR.fullmatch(step_dir):
        head, _, name = key.partition("/")
        return f"{head}/{step_dir}/{name}"
    return f"{step_dir}/{key}"


def unplaced(root_key: str) -> tuple[str, str] | None:
    """``(step directory, key in its manifest)`` of a root-relative key a step stores
    (:func:`placed`'s inverse), or None outside step directories."""
    parts = root_key.split("/")
    if len(parts) >= 2 and STEP_DIR.fullmatch(parts[0]):
        return parts[0], "/".join(parts[1:])
    if len(parts) == 3 and is_spread_dir(parts[0]) and STEP_DIR.fullmatch(parts[1]):
        return parts[1], f"{parts[0]}/{parts[2]}"
    return None


def _resolve(base: str, key: str) -> str:
    """The path (or URL) of ``key`` relative to the location ``base``: a sibling key
    (``../<dir>/<key>``) and a step directory's spread key (:func:`placed`) are
    resolved against ``base``'s parent."""
    base = base.rstrip("/")
    if key.startswith("../") and ".." not in key[3:].split("/"):
        step_dir, _, inner = key[3:].partition("/")
        return f"{base.rsplit('/', 1)[0]}/{placed(step_dir, inner) if inner else step_dir}"
    parent, _, name = base.rpartition("/")
    if parent and is_spread_key(key) and STEP_DIR.fullmatch(name):
        return f"{parent}/{placed(name, key)}"
    return f"{base}/{key}"


# fsspec's own constructor options, which every filesystem accepts.
_FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
)


def _declared(cls: type) -> set[str]:
    """Keyword options the constructors along ``cls``'s MRO name, up to fsspec's base."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (AbstractFileSystem, object) or "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names - {"self"}


def backend_options(protocol: str) -> frozenset[str] | None:
    """The storage option names the backend of ``protocol`` takes, or None where
    that cannot be told.

    Told for S3 (s3fs hands the keywords its constructor does not name to
    aiobotocore's session, which rejects unknown ones only at the first request,
    as a bare ``TypeError``), GCS, Azure and memory (whose leftovers fsspec and
    adlfs drop silently, so a typo'd name is ignored): from their constructors' signatures, so
    no backend parameter is declared twice. Other backends may pass leftovers on
    to their HTTP client, so any name may be meant.
    """
    if protocol not in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"):
        return None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        return None  # opening the store says which extra to install
    names = _declared(cls) | _FSSPEC_OPTIONS
    if protocol in ("s3", "s3a"):
        from aiobotocore.session import AioSession

        names |= _declared(AioSession)
    return frozenset(names)
