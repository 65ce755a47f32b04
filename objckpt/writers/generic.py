"""Any fsspec store: GCS, memory, and a best-effort fallback for the rest.

GCS objects go up streamed (:mod:`objckpt.writers.gcs_compose`): up to two parts in
one request, larger ones as parallel composite uploads. Every other store's objects
are buffered and written in one request.

GCS commits with ``ifGenerationMatch=0`` (gcsfs's ``mode="create"``), which the
service enforces atomically. The memory store is process-local, so a lock makes
its check-then-write atomic. Other protocols have no create-only write that
objckpt knows of; they get an existence check before the write and a warning,
because two writers racing on the same URL could both believe they committed.
"""

from __future__ import annotations

import logging
import threading

from objckpt.errors import AccessDeniedError
from objckpt.writers.base import PREFLIGHT_GRACE, BufferedUpload, ObjectStore, ObjectUpload
from objckpt.writers.checksum import crc_from_base64
from objckpt.writers.gcs_compose import CompositeUpload, MediaUpload
from objckpt.writers.translate import translate

__all__ = ["GcsStore", "GenericStore", "MemoryStore"]

logger = logging.getLogger(__name__)


class GenericStore(ObjectStore):
    """Buffered uploads through fsspec, check-then-write commit (not atomic)."""

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        return BufferedUpload(self, key, size_hint)

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        logger.warning(
            "%s:// has no create-only write known to objckpt; committing %s with a "
            "check-then-write that is not atomic against a concurrent writer",
            self.location.protocol,
            self.location.url_of(key),
        )
        if not overwrite and self.exists(key):
            raise FileExistsError(self.location.url_of(key))
        self.put(key, data)


#: What a save needs on GCS: write objects, and list them (the "already committed?" check).
GCS_SAVE_PERMISSIONS = ("storage.objects.create", "storage.objects.list")


class GcsStore(GenericStore):
    """GCS through gcsfs: the commit is an ``ifGenerationMatch=0`` upload."""

    atomic_create = True
    keeps_crc32c = True  # GCS keeps every object's CRC32C

    def preflight(self, timeout: float) -> None:
        """The bucket check, then GCS's ``testIamPermissions``, which answers with the
        subset of :data:`GCS_SAVE_PERMISSIONS` the caller holds: read-only credentials
        are refused here, before anything is staged, without writing a probe object."""
        super().preflight(timeout)
        bucket, url = self.location.bucket, self.location.url
        query = "&".join(f"permissions={p}" for p in GCS_SAVE_PERMISSIONS)
        try:
            with self.preflight_bound(timeout):
                answer = self.run_coro(
                    self._fs._call(
                        "GET", f"b/{{}}/iam/testPermissions?{query}", bucket, json_out=True
                    ),
                    timeout=timeout + PREFLIGHT_GRACE,
                )
        except FileNotFoundError:
            # The bucket exists (checked just above), so this server has no
            # testIamPermissions (an emulator such as fake-gcs-server): the first
            # write will tell instead.
            logger.info("%s does not answer testIamPermissions; permissions unchecked", url)
            return
        except Exception as exc:
            raise translate(exc, url=url, action="testing permissions on") from exc
        missing = sorted(set(GCS_SAVE_PERMISSIONS) - set(answer.get("permissions") or []))
        if missing:
            raise AccessDeniedError(
                f"access denied for {url}: the credentials lack {', '.join(missing)} on "
                f"bucket {bucket!r} (read-only credentials?); a save needs "
                f"{' and '.join(GCS_SAVE_PERMISSIONS)}"
            )

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        """Objects up to two parts go up in one streamed request; larger ones as
        parallel composite uploads (:mod:`objckpt.writers.gcs_compose`)."""
        part = self.parted_part_size(size_hint)
        if part is not None:
            return CompositeUpload(self, key, part)
        return MediaUpload(self, key, self.options.part_size)

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        # A 412 may reach here by another route than gcsfs's FileExistsError.
        self.pipe_create(key, data, overwrite=overwrite)

    server_side_copy = True

    def _copy_inside(self, src: ObjectStore, key: str, size: int) -> None:
        """A rewrite inside GCS (gcsfs's ``cp_file``); GCS keeps every object's CRC32C."""
        self._fs.cp_file(src.path(key), self.path(key))

    def digest(self, key: str) -> tuple[int, str | None]:
        info = self.fresh_info(key)
        crc = info.get("crc32c")
        return int(info.get("size") or 0), crc_from_base64(crc) if crc else None


class MemoryStore(GenericStore):
    """fsspec's in-process memory store; a lock makes the commit create-only."""

    atomic_create = True
    shared_by_processes = False  # each process has its own

    # The memory filesystem's contents are process-global, so its commit lock is too.
    _commit_lock = threading.Lock()

    def preflight(self, timeout: float) -> None:
        return None

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        with self._commit_lock:
            if not overwrite and self._fs.exists(self.path(key)):
                raise FileExistsError(self.location.url_of(key))
            self._fs.pipe_file(self.path(key), data)
