"""Local disk: direct file writes, fsync, and an exclusive-create commit.

Payload files are written in place under names that carry the attempt id, opened
with ``O_EXCL`` so nothing is ever overwritten; a crash leaves a partial file that
no manifest names (garbage for ``gc``). The manifest is written to a temporary
file, fsynced, then hard-linked to its final name: ``link`` fails if the name
exists, which makes the commit create-only and atomic, and the directory is
fsynced so the commit survives a power loss.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import uuid
from typing import BinaryIO

from objckpt.errors import BucketNotFoundError
from objckpt.writers.base import ObjectStore, ObjectUpload, translated_future
from objckpt.writers.checksum import BytesLike
from objckpt.writers.translate import translate

__all__ = ["LocalStore"]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(ObjectStore):
    """Writes objects as files under a local directory."""

    atomic_create = True  # a hard link of a complete temporary file fails if the name exists
    shared_by_processes = False  # a path may be node-local (a LocalTier)

    def preflight(self, timeout: float) -> None:
        root = self.location.path
        parent = root
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise BucketNotFoundError(
                f"{parent} is not a directory (checkpoint URL {self.location.url})"
            )
        if not os.access(parent, os.W_OK):
            raise translate(
                PermissionError(f"{parent} is not writable"),
                url=self.location.url,
                action="checking",
            )

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        return LocalUpload(self, key)

    def _write_tmp(self, key: str, data: bytes | bytearray) -> str:
        os.makedirs(self.location.path, exist_ok=True)
        tmp = self.path(f".{key}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes | bytearray) -> None:
        try:
            tmp = self._write_tmp(key, data)
            os.replace(tmp, self.path(key))
            _fsync_dir(self.location.path)
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="writing") from exc

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        if overwrite:
            self.put(key, data)
            return
        try:
            tmp = self._write_tmp(key, data)
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="committing") from exc
        try:
            os.link(tmp, self.path(key))
        except FileExistsError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="committing") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(self.location.path)


class LocalUpload(ObjectUpload):
    """Writes straight into the final file; fsync runs on the store's pool."""

    def __init__(self, store: LocalStore, key: str) -> None:
        super().__init__(key)
        self._store = store
        self._path = store.path(key)
        self._file: BinaryIO | None = None
        self._created = False  # abort removes the file only if this upload made it

    def _open(self) -> BinaryIO:
        if self._file is None:
            try:
                os.makedirs(os.path.dirname(self._path), exist_ok=True)
                self._file = open(self._path, "xb")  # noqa: SIM115 - closed in close()/abort()
                self._created = True
            except Exception as exc:
                raise translate(
                    exc, url=self._store.location.url_of(self.key), action="writing"
                ) from exc
        return self._file

    def write(self, data: BytesLike) -> None:
        f = self._open()
        try:
            f.write(data)
        except Exception as exc:
            raise translate(
                exc, url=self._store.location.url_of(self.key), action="writing"
            ) from exc

    def close(self) -> concurrent.futures.Future[None]:
        f = self._open()
        self._file = None

        def finish() -> None:
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()

        return translated_future(
            self._store.submit_call(finish), self._store.location.url_of(self.key), "writing"
        )

    def abort(self) -> None:
        if self._file is not None:
            # Closing flushes what the file still buffers, which fails the way the
            # write that led here failed (a full disk): the error being raised is
            # the caller's, and the file goes anyway (the descriptor is closed).
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
