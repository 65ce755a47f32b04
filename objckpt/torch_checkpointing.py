"""torch_checkpointing integration: a ``Storage`` that commits with objckpt's manifest.

``CheckpointManager.Config(storage_config=ObjckptStorageConfig(root, storage_options=...))``
runs torch_checkpointing's ``CheckpointManager`` on any store objckpt supports
(``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``), through objckpt's store
layer (:mod:`objckpt.writers`: retries, deadlines, multipart uploads, CRC32C).

Why the rename is a manifest. torch_checkpointing writes a checkpoint under a temporary
directory (``<root>/tmp_<name>``) and commits it by renaming that directory to its final
name. On an object store a directory rename is a copy of every object, and not atomic.
Here the temporary directory is a name only: its files are stored where the checkpoint
will live (``<root>/<name>/<file>``), each with a small record of its size and CRC32C
written by the rank that uploaded it (``<root>/<name>/__objckpt_sums/<file>.json``), and
the rename writes ``<root>/<name>/manifest.json`` create-only, listing every file with
its size and CRC32C: objckpt's commit (:func:`objckpt.format.commit.commit_manifest`,
settled by read-back), no byte copied. Until that PUT lands, ``<name>`` does not exist
for :meth:`ObjckptStorage.exists`, :meth:`~ObjckptStorage.ls` or a reader, and a second
commit of the same name is refused (``CheckpointExistsError``, a ``FileExistsError``).

Why every read is checked. A committed checkpoint is read through its manifest: a file
it does not list does not exist, and a file read front to back is checked against the
manifest's CRC32C when its last byte arrives (before the caller sees that byte), so
``metadata.pkl``, which torch_checkpointing passes to ``pickle.loads``, and the
``torch.load``-ed ``.pt`` files are never handed over unless they are the bytes the job
wrote. A reader that seeks (torch_checkpointing's resharder reads slices) gets the whole
object fetched and checked on its first seek, then served from memory.

Layout rule: checkpoints are the direct children of ``root`` (``save("step_10")``, or the
full URL ``s3://bucket/run/step_10`` when ``root`` is ``s3://bucket/run``); files inside a
checkpoint may nest. Needs the optional ``torch-checkpointing`` extra.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "objckpt.torch_checkpointing needs torch_checkpointing: "
        "pip install 'objckpt[torch-checkpointing]'"
    ) from exc

from objckpt.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    ConfigurationError,
    ManifestError,
    SizeMismatchError,
    UploadError,
)
from objckpt.format.commit import commit_manifest
from objckpt.format.layout import MANIFEST_KEY, new_attempt_id
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

__all__ = ["ObjckptStorage", "ObjckptStorageConfig"]

logger = logging.getLogger(__name__)

#: Where a checkpoint's per-file records (size and CRC32C) are kept until the commit.
SUMS_DIR = "__objckpt_sums"
_MiB = 1024 * 1024
#: ``s3://b/run`` as ``pathlib.Path`` spells it (``s3:/b/run``).
_MANGLED_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/(?!/)(.*)$")


@dataclasses.dataclass(kw_only=True)
class ObjckptStorageConfig(StorageConfig):
    """Where torch_checkpointing's checkpoints go, and how to reach the store.

    A dataclass as torch_checkpointing's ``StorageConfig`` is (not frozen: its base is
    not); pickled to torch_checkpointing's writer subprocess.

    Args:
        root: URL of the directory holding the checkpoints (each one a direct child).
        storage_options: fsspec options (endpoint, credentials), passed untouched.
        temp_dir_prefix: The ``CheckpointWriterConfig.temp_dir_prefix`` the writer uses
            (its default, ``tmp_``): ``<prefix><name>`` is the staging name of ``<name>``.
        upload: Part sizes and uploads in flight (:class:`~objckpt.UploadOptions`).
        retry: How store requests are retried (:class:`~objckpt.RetryPolicy`).
        read_block_size: Largest ranged GET of a streamed read (``readinto``).
    """

    root: str
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    temp_dir_prefix: str = "tmp_"
    upload: UploadOptions | None = None
    retry: RetryPolicy | None = None
    read_block_size: int = 8 * _MiB

    def __post_init__(self) -> None:
        if not self.temp_dir_prefix or "/" in self.temp_dir_prefix:
            raise ConfigurationError(
                f"option temp_dir_prefix={self.temp_dir_prefix!r} is invalid: a non-empty "
                "name prefix without '/' is expected (torch_checkpointing's default is 'tmp_')"
            )
        if self.read_block_size < 1:
            raise ConfigurationError(
                f"option read_block_size={self.read_block_size!r} is invalid: expected > 0"
            )
        Location.parse(self.root, self.storage_options)  # a bad URL fails here, not later

    def create_storage(self) -> ObjckptStorage:
        return ObjckptStorage(self)


@dataclasses.dataclass(frozen=True)
class _Name:
    """A path relative to the root, split: the checkpoint it is in and the rest.

    Attributes:
        checkpoint: The checkpoint's final name ("" for the root itself).
        staging: Whether the path named the checkpoint's temporary directory.
        rest: The path inside the checkpoint ("" for the checkpoint itself).
    """

    checkpoint: str
    staging: bool
    rest: str


class ObjckptStorage(Storage):
    """torch_checkpointing's ``Storage`` on an objckpt store (the module doc says how).

    Made by :meth:`ObjckptStorageConfig.create_storage`, once per torch_checkpointing
    reader or writer (its writer subprocess makes its own).
    """

    def __init__(self, config: ObjckptStorageConfig) -> None:
        self._config = config
        self._root = Location.parse(config.root, config.storage_options, config.retry)
        self._store = open_store(self._root, config.upload)
        # A committed manifest never changes (only a deletion removes it, here or elsewhere).
        self._manifests: dict[str, Manifest] = {}

    # -- names ---------------------------------------------------------------------------
    def _relative(self, path: Path | str) -> str:
        text = os.fspath(path)
        mangled = _MANGLED_URL.match(text)
        if mangled is not None:  # s3://b/run/x came through pathlib as s3:/b/run/x
            text = f"{mangled.group(1)}://{mangled.group(2)}"
        if "://" in text:
            root = self._root.url.rstrip("/")
            if not (text == root or text.startswith(root + "/")):
                raise ConfigurationError(
                    f"{text} is not under this storage's root {root}: checkpoints are the "
                    "root's direct children"
                )
            text = text[len(root) :]
        parts = [p for p in text.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ConfigurationError(f"path {text!r} must not contain '..'")
        return "/".join(parts)

    def _name(self, path: Path | str) -> _Name:
        rel = self._relative(path)
        if not rel:
            return _Name("", False, "")
        top, _, rest = rel.partition("/")
        prefix = self._config.temp_dir_prefix
        if top.startswith(prefix) and len(top) > len(prefix):
            return _Name(top[len(prefix) :], True, rest)
        return _Name(top, False, rest)

    def _checkpoint_store(self, checkpoint: str) -> ObjectStore:
        """A store at one checkpoint's directory, sharing the root store's client."""
        return self._store.child(checkpoint)

    def remap_path(self, path: Path) -> str:
        rel = self._relative(path)
        return self._root.url_of(rel) if rel else self._root.url

    # -- what is committed -------------------------------------------------------------
    def _manifest(self, checkpoint: str, *, fresh: bool = False) -> Manifest | None:
        """The checkpoint's manifest, or None while it is not committed."""
        if not fresh and checkpoint in self._manifests:
            return self._manifests[checkpoint]
        try:
            manifest = read_manifest(self._checkpoint_store(checkpoint))
        except FileNotFoundError:
            self._manifests.pop(checkpoint, None)
            return None
        self._manifests[checkpoint] = manifest
        return manifest

    def _committed(self, checkpoint: str) -> bool:
        return self._store.exists(f"{checkpoint}/{MANIFEST_KEY}")

    def _staged(self, checkpoint: str) -> dict[str, int]:
        """Size by path of each file staged for ``checkpoint`` (records not included)."""
        return {
            o.key: o.size
            for o in self._store.child(checkpoint).inventory()
            if o.key != MANIFEST_KEY and not o.key.startswith(SUMS_DIR + "/")
        }

    def _files(self, name: _Name) -> dict[str, int] | None:
        """Size by path of the files of the (committed or staging) directory ``name``
        names, or None when it does not exist."""
        if name.staging:
            if self._committed(name.checkpoint):
                return None  # committed: the temporary name is gone, as after a rename
            return self._staged(name.checkpoint) or None
        manifest = self._manifest(name.checkpoint, fresh=not name.rest)
        if manifest is None:
            return None
        return {o.key: o.size for o in manifest.objects}

    def _entry(self, path: Path | str) -> tuple[str, ObjectEntry]:
        """The store key of the file at ``path`` and the size and CRC32C it must have:
        from the manifest when committed, from the uploading rank's record when staged."""
        name = self._name(path)
        if not name.checkpoint or not name.rest:
            raise IsADirectoryError(f"{self.remap_path(Path(path))} is a directory")
        key = f"{name.checkpoint}/{name.rest}"
        if not name.staging:
            manifest = self._manifest(name.checkpoint)
            entry = None if manifest is None else manifest.object(name.rest)
        else:
            entry = None if self._committed(name.checkpoint) else self._record(key)
        if entry is None:
            raise FileNotFoundError(f"{self.remap_path(Path(path))} does not exist")
        return key, entry

    def _record(self, key: str) -> ObjectEntry | None:
        checkpoint, _, rest = key.partition("/")
        try:
            return _read_record(self._checkpoint_store(checkpoint), rest)
        except FileNotFoundError:
            return None

    # -- writes --------------------------------------------------------------------------
    def _write_key(self, path: Path) -> str:
        name = self._name(path)
        if not name.staging or not name.rest:
            raise ConfigurationError(
                f"objckpt writes checkpoints only under their temporary directory "
                f"({self._config.temp_dir_prefix}<name>/<file> under {self._root.url}), not "
                f"{self.remap_path(path)}: keep CheckpointWriterConfig(write_to_temp_dir=True) "
                "and the same temp_dir_prefix on both configs"
            )
        if name.rest in (MANIFEST_KEY, SUMS_DIR) or name.rest.startswith(SUMS_DIR + "/"):
            raise ConfigurationError(
                f"{name.rest.split('/', 1)[0]} is objckpt's own name inside a checkpoint"
            )
        if self._committed(name.checkpoint):
            raise CheckpointExistsError(
                f"{self._root.url_of(name.checkpoint)} is committed; a checkpoint is never "
                "written again (delete it first to replace it)"
            )
        return f"{name.checkpoint}/{name.rest}"

    def stream_write(self, path: Path) -> io.IOBase:
        """An upload through :meth:`objckpt.writers.ObjectStore.begin` behind a file (a
        multipart upload with parts in flight above twice the part size): closing it
        finishes the object and records its size and CRC32C; leaving its ``with`` block
        on an error aborts the upload."""
        return _UploadStream(self._store, self._write_key(path))

    def write(self, path: Path, data: Any) -> None:
        with _UploadStream(self._store, self._write_key(path)) as f:
            f.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Nothing to create on an object store; a committed name is refused here
        already, before any byte is written."""
        name = self._name(path)
        if name.staging and self._committed(name.checkpoint):
            raise CheckpointExistsError(
                f"{self._root.url_of(name.checkpoint)} is committed; a checkpoint is never "
                "written again (delete it first to replace it)"
            )

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        """The commit: the temporary directory ``<prefix><name>`` onto ``<name>``.

        Raises:
            CheckpointExistsError: ``<name>`` is committed already (a ``FileExistsError``,
                an ``OSError`` as the ``Storage.rename`` table asks).
            UploadError: A staged file has no record of a finished upload, or a record
                has no file (nothing is committed).
            OSError: Anything but a temporary directory onto its own final name.
        """
        src, dst = self._name(src_path), self._name(dst_path)
        if not (src.staging and not src.rest and not dst.staging and not dst.rest):
            raise OSError(
                f"objckpt commits a temporary checkpoint directory onto its final name only; "
                f"renaming {self.remap_path(src_path)} to {self.remap_path(dst_path)} would be "
                "a copy on an object store"
            )
        if src.checkpoint != dst.checkpoint:
            raise OSError(
                f"{self.remap_path(src_path)} is the temporary directory of "
                f"{self._root.url_of(src.checkpoint)}, not of {self.remap_path(dst_path)}"
            )
        if self._committed(src.checkpoint):  # the create-only PUT settles any race
            raise CheckpointExistsError(
                f"{self._root.url_of(src.checkpoint)} is committed already; a second commit "
                "of a name is refused"
            )
        self._commit(src.checkpoint)

    def _commit(self, checkpoint: str) -> None:
        store = self._checkpoint_store(checkpoint)
        url = store.location.url
        staged = self._staged(checkpoint)
        records = self._records(store)
        unfinished = sorted(k for k in staged if k not in records)
        lost = sorted(k for k in records if k not in staged)
        if unfinished or lost:
            problems = []
            if unfinished:
                named = ", ".join(unfinished[:8])
                problems.append(
                    f"{len(unfinished)} files have no record of a finished upload ({named})"
                )
            if lost:
                problems.append(f"{len(lost)} recorded files are gone ({', '.join(lost[:8])})")
            raise UploadError(
                f"refusing to commit {url}: {'; '.join(problems)}; nothing was committed"
            )
        try:
            manifest = commit_manifest(
                store,
                attempt=new_attempt_id(),
                world_size=_world_size(),
                objects=records.values(),
                metadata={"torch_checkpointing": {"files": len(records)}},
                user=None,
                requests=None,
                overwrite=False,
            )
        except FileExistsError as exc:
            if isinstance(exc, CheckpointExistsError):
                raise
            raise CheckpointExistsError(f"{url} is committed already: {exc}") from exc
        self._manifests[checkpoint] = manifest
        # The records served the commit; what is left of them (a crash here) is garbage.
        try:
            store.delete_many([f"{SUMS_DIR}/{k}.json" for k in records])
        except Exception:
            logger.warning("could not remove the upload records of %s", url, exc_info=True)

    def _records(self, store: ObjectStore) -> dict[str, ObjectEntry]:
        keys = [
            o.key
            for o in store.inventory()
            if o.key.startswith(SUMS_DIR + "/") and o.key.endswith(".json")
        ]
        if not keys:
            return {}
        files = [k[len(SUMS_DIR) + 1 : -len(".json")] for k in keys]
        with concurrent.futures.ThreadPoolExecutor(min(16, len(files))) as pool:
            entries = list(pool.map(lambda rest: _read_record(store, rest), files))
        return {e.key: e for e in entries}

    # -- deletes -------------------------------------------------------------------------
    def delete(self, path: Path) -> None:
        """Delete one staged file; a committed checkpoint's files go only with it."""
        name = self._name(path)
        if not name.staging:
            raise OSError(
                f"{self.remap_path(path)} is part of a committed checkpoint; delete the "
                "checkpoint (rmdir) instead"
            )
        key = self._write_key(path)
        checkpoint, _, rest = key.partition("/")
        self._store.delete_many([key, f"{checkpoint}/{SUMS_DIR}/{rest}.json"])

    def rmdir(self, path: Path) -> None:
        """Delete a checkpoint (its manifest first: it is gone for every reader before any
        other object goes) or a failed save's leftovers (its temporary directory), open
        multipart uploads included."""
        name = self._name(path)
        if not name.checkpoint or name.rest:
            raise OSError(f"{self.remap_path(path)} is not a checkpoint directory")
        committed = self._committed(name.checkpoint)
        if name.staging and committed:
            raise FileNotFoundError(f"{self.remap_path(path)} does not exist (committed)")
        store = self._checkpoint_store(name.checkpoint)
        if not name.staging:
            if not committed:
                raise FileNotFoundError(f"{self.remap_path(path)} does not exist")
            store.delete(MANIFEST_KEY)  # gone for every reader before any file goes
            self._manifests.pop(name.checkpoint, None)
        keys = [o.key for o in store.inventory()]
        uploads = store.open_uploads()
        if name.staging and not keys and not uploads:
            raise FileNotFoundError(f"{self.remap_path(path)} does not exist")
        store.delete_many(keys)
        for upload in uploads:
            store.abort_upload(upload)

    # -- what is there -------------------------------------------------------------------
    def exists(self, path: Path) -> bool:
        name = self._name(path)
        if not name.checkpoint:
            return True
        files = self._files(name)
        if files is None:
            return False
        return not name.rest or name.rest in files or _is_dir(name.rest, files)

    def isdir(self, path: Path) -> bool:
        name = self._name(path)
        if not name.checkpoint:
            return True
        files = self._files(name)
        return files is not None and (not name.rest or _is_dir(name.rest, files))

    def getsize(self, path: Path) -> int:
        return self._entry(path)[1].size

    def ls(self, path: Path) -> list[str]:
        """Names directly under ``path``. At the root: each committed checkpoint, and
        ``<prefix><name>`` for a save that has staged files but is not committed."""
        name = self._name(path)
        if not name.checkpoint:
            return self._ls_root()
        files = self._files(name)
        if files is None or (name.rest and name.rest in files):
            raise FileNotFoundError(f"{self.remap_path(path)} is not a directory")
        inner = name.rest + "/" if name.rest else ""
        return sorted({k[len(inner) :].split("/", 1)[0] for k in files if k.startswith(inner)})

    def _ls_root(self) -> list[str]:
        names = []
        for entry in self._store.listing():
            listing = self._store.listing(entry)
            if MANIFEST_KEY in listing:
                names.append(entry)
            elif any(k != SUMS_DIR for k in listing):
                names.append(self._config.temp_dir_prefix + entry)
        return sorted(names)

    # -- reads ---------------------------------------------------------------------------
    @property
    def mmap_fill_workers(self) -> int | None:
        """One front-to-back stream per file: each byte is checked against the CRC32C
        as it arrives (parallel ranged fills could not be)."""
        return 1

    @property
    def mmap_fill_chunk_bytes(self) -> int | None:
        return self._config.read_block_size

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        key, entry = self._entry(path)
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self._read_checked(key, entry))  # type: ignore[return-value]
        if read_args.known_size_bytes is not None and read_args.known_size_bytes != entry.size:
            raise SizeMismatchError(
                f"{self._root.url_of(key)} is {entry.size} bytes, the reader expected "
                f"{read_args.known_size_bytes}"
            )
        return _RangedReader(self, key, entry)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        key, entry = self._entry(path)
        return self._read_checked(key, entry)

    def _read_checked(self, key: str, entry: ObjectEntry) -> bytes:
        data = self._store.read(key)
        _check(self._root.url_of(key), entry, len(data), _crc(data))
        return data

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(
            self._store.retrying(
                lambda: self._store.read_range(key, start, end),
                f"reading {self._root.url_of(key)}",
            )
        )


def _world_size() -> int:
    """The ranks of the job, for the manifest: the process group where this process
    has one (a synchronous save), else torchrun's ``WORLD_SIZE`` (torch_checkpointing's
    writer subprocess inherits the environment)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


#: A record is ``{"size": N, "crc32c": "8 hex"}``: far below this.
_RECORD_LIMIT = 1024


def _read_record(store: ObjectStore, rest: str) -> ObjectEntry:
    """The record of file ``rest`` of the checkpoint at ``store``: bucket contents, so
    bounded and validated before it is used (a ManifestError names it otherwise).

    Raises:
        FileNotFoundError: There is no record (the file's upload did not finish).
    """
    key = f"{SUMS_DIR}/{rest}.json"
    url = store.location.url_of(key)
    blob = store.read_bounded(key, _RECORD_LIMIT)
    try:
        if len(blob) > _RECORD_LIMIT:
            raise ValueError(f"over {_RECORD_LIMIT} bytes")
        raw = json.loads(blob)
        size, crc = raw["size"], raw["crc32c"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size {size!r}")
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise ValueError(f"crc32c {crc!r}")
    except (ValueError, TypeError, KeyError) as exc:
        raise ManifestError(
            f"upload record {url} is malformed ({exc}); nothing is committed"
        ) from exc
    return ObjectEntry(rest, size, crc)


def _is_dir(rest: str, files: Mapping[str, int]) -> bool:
    prefix = rest.rstrip("/") + "/"
    return any(k.startswith(prefix) for k in files)


def _crc(data: Any) -> str:
    crc = Crc32c()
    crc.update(data)
    return crc.hexdigest()


def _check(url: str, entry: ObjectEntry, size: int, crc: str) -> None:
    if size != entry.size:
        raise SizeMismatchError(f"{url} is {size} bytes, the manifest says {entry.size}")
    if crc != entry.crc32c:
        raise ChecksumMismatchError(f"{url} has CRC32C {crc}, the manifest says {entry.crc32c}")


class _UploadStream(io.RawIOBase):
    """One object written through :meth:`ObjectStore.begin` (parts in flight as they
    fill), then its record: the size and CRC32C the commit lists."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        super().__init__()
        self._store = store
        self._key = key
        checkpoint, _, rest = key.partition("/")
        self._record_key = f"{checkpoint}/{SUMS_DIR}/{rest}.json"
        # A record left by an earlier, failed save of this name must not vouch for these
        # bytes: from here until this upload's own record, the file has none.
        store.delete(self._record_key)
        self._upload = store.begin(key, 0)
        self._crc = Crc32c()
        self._size = 0
        self._failed = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            crc = self._upload.write(view)
        except BaseException:
            self._failed = True
            raise
        self._crc.feed(view, crc)
        self._size += len(view)
        return len(view)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._failed = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._failed:
                self._upload.abort()
                return
            try:
                self._upload.close().result()
            except BaseException:
                self._upload.abort()
                raise
            record = json.dumps({"size": self._size, "crc32c": self._crc.hexdigest()}).encode()
            # Through begin(), as the file went: put() is for flat keys on every family.
            up = self._store.begin(self._record_key, len(record))
            try:
                up.write(record)
                up.close().result()
            except BaseException:
                up.abort()
                raise
        finally:
            super().close()


class _RangedReader(io.RawIOBase):
    """A committed file read in ranged GETs of at most ``read_block_size`` bytes.

    Read front to back, each byte feeds a running CRC32C and the read that reaches the
    end compares it with the manifest's before returning; after a seek elsewhere, the
    whole object is fetched and checked once and the rest served from memory.
    """

    def __init__(self, storage: ObjckptStorage, key: str, entry: ObjectEntry) -> None:
        super().__init__()
        self._storage = storage
        self._key = key
        self._entry = entry
        self._pos = 0
        self._checked_to = 0  # bytes [0, _checked_to) fed to _crc, in order
        self._crc = Crc32c()
        self._whole: bytes | None = None
        if entry.size == 0:
            _check(self._url, entry, 0, self._crc.hexdigest())

    @property
    def _url(self) -> str:
        return self._storage._root.url_of(self._key)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._entry.size}[whence]
        target = base + offset
        if target < 0:
            raise OSError(f"seek to {target} in {self._url}")
        self._pos = target
        return target

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        size = self._entry.size
        n = min(len(out), size - self._pos)
        if n <= 0:
            return 0
        if self._whole is None and self._pos != self._checked_to:
            data = self._storage._read_checked(self._key, self._entry)
            self._whole = data
        if self._whole is not None:
            out[:n] = self._whole[self._pos : self._pos + n]
            self._pos += n
            return n
        n = min(n, self._storage._config.read_block_size)
        data = self._storage._read_range(self._key, self._pos, self._pos + n)
        if len(data) != n:
            raise SizeMismatchError(
                f"{self._url} ended at {self._pos + len(data)} bytes, the manifest says {size}"
            )
        self._crc.update(data)
        self._checked_to += n
        if self._checked_to == size:  # the last byte: checked before the caller has it
            _check(self._url, self._entry, size, self._crc.hexdigest())
        out[:n] = data
        self._pos += n
        return n
