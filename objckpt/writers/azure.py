"""Azure Blob Storage (``az://``, ``abfs://``, ``abfss://`` through adlfs): the store
family behind :class:`AzureStore`.

**The commit** is one Put Blob with ``If-None-Match: *`` (adlfs's
``pipe_file(mode="create")``; azure-storage-blob sets the header when asked not to
overwrite). The service enforces it atomically and answers a second create with 409
``BlobAlreadyExists``; adlfs raises ``FileExistsError`` for it, which the commit
settles by reading the manifest back as on S3 and GCS
(:mod:`objckpt.format.settle`): a retried Put Blob that meets its own earlier write
is ours, anyone else's is ``CheckpointExistsError``.

**Large objects** go up as Azure's multipart: blocks staged concurrently (Put Block,
each with its CRC64, which the service checks, as it checks every Put Blob's:
:mod:`objckpt.writers.azureclient`) and made the blob in one
Put Block List, so a reader sees either no blob or the whole of it, never a
part (:class:`BlockUpload`). Blocks go up under the store's request limit
(``UploadOptions.max_parts_in_flight``, AIMD like S3's parts), so the memory held is
bounded by ``max_parts_in_flight * part_size``. Smaller objects are one Put Blob of the
buffered bytes; azure-storage-blob itself would split anything over its
``max_single_put_size`` (64 MiB) into 4 MiB staged blocks and one block list,
equally atomic.

**Leftovers**: staged blocks that were never committed (a crash or an aborted
upload) are invisible to listings and reads, cannot be deleted one by one, and
Azure discards them on its own after seven days (or when a blob of that name is
committed). There is nothing for ``objckpt gc`` to find or abort, so
:meth:`AzureStore.open_uploads` is empty. A blob that was committed but never
named by a manifest is ordinary garbage for ``gc``.

**Checksums**: Azure keeps an MD5 for single-request blobs and none for
block-list blobs, and no CRC32C: :meth:`AzureStore.digest` reports none, and
objckpt checks its own CRC32C from the manifest (on verify, copies and backups).

**Retries** are objckpt's, as on S3 and GCS: the service client is built with
:class:`~objckpt.writers.azureclient.ObjckptRetry` in azure-core's retry policy's
place and the transport's timeouts at ``RetryPolicy.timeout``
(:mod:`objckpt.writers.azureclient`), so every Azure request follows
:class:`~objckpt.RetryPolicy`, ``give_up_after``, ``preflight_timeout`` and the
save's deadline, and a stopped endpoint fails with
:class:`~objckpt.errors.StoreUnreachableError` in their time.
"""

from __future__ import annotations

import base64
import concurrent.futures
import uuid
from typing import Any

from objckpt.errors import BucketNotFoundError
from objckpt.writers.base import (
    PREFLIGHT_GRACE,
    BufferedUpload,
    ObjectStore,
    ObjectUpload,
    PartedUpload,
    translated_future,
)
from objckpt.writers.body import Part, StreamedBody
from objckpt.writers.checksum import crc32c_combine, format_crc
from objckpt.writers.translate import causes, precondition_failed, service_error, translate

__all__ = ["AzureStore", "BlockUpload"]

#: Azure's largest block (Put Block, service versions 2019-12-12 and later):
#: 4,000 MiB, below S3's largest part.
MAX_BLOCK = 4000 * 1024 * 1024

#: What adlfs writes on every blob it creates (it tells blobs from its directory markers).
_BLOB_METADATA = {"is_directory": "false"}


def _already_exists(exc: BaseException) -> bool:
    """Azure's answer to a create-only write of an existing blob: 409
    ``BlobAlreadyExists`` (or a 412 where a store answers the condition so)."""
    if precondition_failed(exc):
        return True
    for seen in causes(exc):
        code, status = service_error(seen)
        if code == "BlobAlreadyExists" or (status == 409 and code is None):
            return True
    return False


class AzureStore(ObjectStore):
    """Writes blobs to Azure Blob Storage (or Azurite) through adlfs."""

    atomic_create = True  # If-None-Match: * on Put Blob

    def container_blob(self, key: str) -> tuple[str, str]:
        """The container and the blob name requests name for ``key``."""
        container, blob, _ = self._fs.split_path(self.path(key))
        return str(container), str(blob)

    def preflight(self, timeout: float) -> None:
        """One listing of at most one blob under the checkpoint's prefix: the container
        exists, the credentials are valid and may list (a save needs that anyway).
        Not adlfs's container check, which on a refused request warns and assumes the
        container exists (a container SAS may not read container properties).

        Raises:
            BucketNotFoundError, AccessDeniedError, StoreUnreachableError: named for
                the URL. Write access is not proven here: read-only credentials are
                refused at the first write.
        """
        container, prefix = self.container_blob("")
        url = self.location.url

        async def first_page() -> None:
            async with self._fs.service_client.get_container_client(container) as client:
                pages = client.list_blobs(name_starts_with=prefix, results_per_page=1).by_page()
                async for _ in pages:
                    return

        try:
            # Bounded in the retry layer, which says what the store answered; the
            # outer wait only backs it up.
            with self.preflight_bound(timeout):
                self.run_coro(first_page(), timeout=timeout + PREFLIGHT_GRACE)
        except Exception as exc:
            code, status = next(
                (found for found in map(service_error, causes(exc)) if found != (None, None)),
                (None, None),
            )
            if code == "ContainerNotFound" or status == 404:
                raise BucketNotFoundError(
                    f"container {container!r} of {url} does not exist"
                ) from exc
            raise translate(exc, url=url, action="checking") from exc

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        """Objects up to two parts go up in one Put Blob; larger ones as staged
        blocks committed with one block list (:class:`BlockUpload`), each block at
        most :data:`MAX_BLOCK` (``part_size`` may be up to S3's 5 GiB)."""
        part = self.parted_part_size(size_hint)
        if part is not None:
            return BlockUpload(self, key, min(part, MAX_BLOCK))
        return BufferedUpload(self, key, size_hint)

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        """One Put Blob, with ``If-None-Match: *`` unless ``overwrite``."""
        self.pipe_create(key, data, overwrite=overwrite, exists=_already_exists)

    def digest(self, key: str) -> tuple[int, str | None]:
        """The blob's size, as listed afresh; Azure keeps no CRC32C (see the module
        docstring)."""
        self._fs.invalidate_cache(self.path(key))
        return super().digest(key)


class BlockUpload(PartedUpload):
    """One large blob: blocks staged concurrently, committed with one block list on close.

    Block ids are this upload's own (a random prefix and the block's number, all of
    one length as Azure requires), so two uploads of one name can never commit each
    other's blocks. A block goes up as the pieces it was written in
    (:class:`~objckpt.writers.body.StreamedBody`), never joined into one ``bytes``:
    a join, and the copies aiohttp's transport makes of a large ``bytes`` body, were
    three passes over every byte of an Azure save.
    """

    def __init__(self, store: AzureStore, key: str, part_size: int) -> None:
        super().__init__(key, part_size)
        self._store = store
        self._prefix = uuid.uuid4().hex[:16]
        self._blocks: list[str] = []
        self._futures: list[concurrent.futures.Future[None]] = []
        self._committing = False
        self._crc = 0  # of the blocks so far, combined

    def _part_full(self, part: Part) -> None:
        block_id = base64.b64encode(f"{self._prefix}-{len(self._blocks):06d}".encode()).decode()
        self._blocks.append(block_id)
        self._crc = crc32c_combine(self._crc, part.crc, part.size)
        store = self._store
        checks = store._fs.transit_check(*part.pieces)  # on the writing thread, not the loop
        store.acquire_slot()  # backpressure: at most max_parts_in_flight blocks in memory
        fut = store.submit_coro(self._put_block(block_id, part, checks))
        fut.add_done_callback(store.release_slot)
        self._futures.append(
            translated_future(fut, store.location.url_of(self.key), "uploading a block of")
        )

    async def _put_block(self, block_id: str, part: Part, checks: dict[str, Any]) -> None:
        """Stage one block, ``checks`` (its checksum, which the service checks) with it.
        The body is seekable: objckpt's retry policy rewinds it before a resend."""
        container, blob = self._store.container_blob(self.key)
        body = StreamedBody(part.pieces)
        async with self._store._fs.service_client.get_blob_client(container, blob) as client:
            await client.stage_block(block_id, body, length=part.size, **checks)

    async def _commit(self) -> Any:
        container, blob = self._store.container_blob(self.key)
        async with self._store._fs.service_client.get_blob_client(container, blob) as client:
            return await client.commit_block_list(list(self._blocks), metadata=_BLOB_METADATA)

    def close(self) -> concurrent.futures.Future[None]:
        if self._part.size or not self._blocks:
            self._part_full(self._take_part())
        self.crc32c = format_crc(self._crc)
        return self._store.submit_call(self._finish)

    def _finish(self) -> None:
        store = self._store
        try:
            for fut in self._futures:
                fut.result()
            self._committing = True
            try:
                store.submit_coro(self._commit()).result()
            except Exception as exc:
                url = store.location.url_of(self.key)
                raise translate(exc, url=url, action="committing the blocks of") from exc
        except BaseException:
            self.abort()
            raise
        finally:
            store._fs.invalidate_cache(store.path(self.key))

    def abort(self) -> None:
        """Wait out blocks still in flight; staged blocks expire on their own (the
        module docstring). A block list whose answer was lost may have landed: the
        blob is deleted then."""
        self._take_part()
        for fut in self._futures:
            fut.exception()
        if self._committing:
            self._store.remove_aborted(self.key)
