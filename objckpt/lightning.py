"""PyTorch Lightning integration: a ``CheckpointIO`` that saves through objckpt.

``Trainer(plugins=[ObjckptCheckpointIO(storage_options=...)])`` makes every checkpoint
Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) a committed objckpt
checkpoint at the path Lightning chose (``s3://bucket/run/checkpoints/epoch=1-step=8.ckpt``
is then a prefix holding a manifest and payload objects, not one file): the manifest
commit, CRC32C on load, parallel multipart uploads. With ``async_save=True`` the save
returns once the state is staged and uploads run in objckpt's worker processes (the
role Lightning's ``AsyncCheckpointIO`` thread plays, without holding the GIL for the
upload); ``teardown`` waits for them.

Lightning saves (and removes) from global rank 0 only, with the whole (replicated)
state, while the other ranks train on; it loads on every rank. So every call here is
this process alone (``no_dist``), sync or async, and makes no collective: under DDP
one would wait for ranks that never join it. Sharded strategies (FSDP,
ModelParallel) save through DCP themselves; give them
:class:`~objckpt.ObjectStoreWriter` instead.

Needs the optional ``lightning`` extra (``pytorch-lightning``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from pytorch_lightning.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "objckpt.lightning needs PyTorch Lightning: pip install 'objckpt[lightning]'"
    ) from exc

from objckpt._torch import load_everything
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.dcp.torch_errors import unwrap
from objckpt.errors import ConfigurationError
from objckpt.ops.maintain.gc import delete_step
from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
from objckpt.pipeline.checkpointer import AsyncCheckpointer
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

__all__ = ["ObjckptCheckpointIO", "WaitStaged"]

logger = logging.getLogger(__name__)


def _int_keyed_optimizer_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state keyed by parameter index again. DCP stores nested keys as
    strings, so ``state[0]`` comes back as ``state["0"]``; torch's optimizers match
    state to ``param_groups[...]["params"]`` by the int, and a resumed run would hold
    both (and fail to save: "duplicated flatten key")."""
    for opt in checkpoint.get("optimizer_states") or []:
        state = opt.get("state") if isinstance(opt, dict) else None
        if isinstance(state, dict):
            opt["state"] = {
                int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()
            }
    return checkpoint


class ObjckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing objckpt checkpoints to any fsspec store.

    Args:
        storage_options: fsspec options for the checkpoint URLs (endpoint, credentials).
        upload: Object and part sizing (:class:`~objckpt.UploadOptions`).
        read: Range sizing and verification on load (:class:`~objckpt.ReadOptions`).
            Non-tensor values are read ``weights_only`` unless ``trust_pickles`` is on
            or Lightning asks with ``weights_only=False``.
        retry: How store requests are retried.
        async_save: Return from ``save_checkpoint`` once the state is staged; uploads
            and the commit continue in the background (``teardown`` waits).
        async_options: Workers and saves in flight for ``async_save``. With
            ``background_staging=True``, register :meth:`staging_callback` with the
            Trainer: ``save_checkpoint`` then returns before the state is copied,
            and the callback waits for the copy before the optimizer changes it.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        upload: UploadOptions | None = None,
        read: ReadOptions | None = None,
        retry: RetryPolicy | None = None,
        async_save: bool = False,
        async_options: AsyncOptions | None = None,
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.upload = upload
        self.read = read or ReadOptions()
        self.retry = retry
        self._async_options = async_options
        self._checkpointer: AsyncCheckpointer | None = None
        self.async_save = async_save
        self._pending: dict[str, SaveHandle] = {}
        self._callback_attached = False

    def staging_callback(
        self, wait_at: Literal["optimizer_step", "batch_start"] = "optimizer_step"
    ) -> WaitStaged:
        """The callback background staging needs: ``Trainer(callbacks=[io.staging_callback()])``.

        Args:
            wait_at: ``"optimizer_step"`` waits just before each optimizer step, so the
                copy overlaps forward and backward. ``"batch_start"`` waits before each
                training batch, for models whose forward changes state in place
                (BatchNorm running statistics), which would otherwise fail the save.
        """
        return WaitStaged(self, wait_at)

    def wait_staged(self) -> None:
        """Return once every save in flight has copied its state (at once when none has
        a copy running)."""
        if self._checkpointer is not None:
            self._checkpointer.wait_staged()

    def _url(self, path: str | os.PathLike[str]) -> str:
        return Location.parse(str(path), self.storage_options).url

    def _settle(self, url: str | None = None) -> None:
        """Wait for in-flight saves (of ``url``, or all); raise the first failure."""
        urls = [url] if url is not None else list(self._pending)
        for u in urls:
            handle = self._pending.pop(u, None)
            if handle is not None:
                handle.result()

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save ``checkpoint`` (Lightning's dict) as a committed checkpoint at ``path``;
        a checkpoint already there (``last.ckpt``) is replaced with the same commit."""
        if storage_options is not None:
            raise TypeError(
                "ObjckptCheckpointIO takes storage options in its constructor, "
                f"not per save (got {storage_options!r})"
            )
        url = self._url(path)
        if not self.async_save:
            writer = ObjectStoreWriter(
                url,
                storage_options=self.storage_options,
                upload=self.upload,
                retry=self.retry,
                overwrite=True,
            )
            dcp.save(checkpoint, storage_writer=writer, no_dist=True)
            return
        background = self._async_options is not None and self._async_options.background_staging
        if background and not self._callback_attached:
            raise ConfigurationError(
                "ObjckptCheckpointIO with AsyncOptions(background_staging=True) needs its "
                "staging callback: Trainer(callbacks=[io.staging_callback()], plugins=[io]); "
                "without it the optimizer could change the weights while they are copied"
            )
        self._settle(url)  # a save to the same path (last.ckpt) waits for the previous
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(
                storage_options=self.storage_options,
                upload=self.upload,
                async_options=self._async_options,
                retry=self.retry,
            )
        self._pending[url] = self._checkpointer.save(checkpoint, url, overwrite=True, no_dist=True)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The whole checkpoint dict at ``path``, rebuilt from its manifest (tensors on CPU;
        Lightning moves them). A save still uploading to ``path`` is waited for."""
        url = self._url(path)
        self._settle(url)
        read = self.read
        if weights_only is False and not read.trust_pickles:
            read = dataclasses.replace(read, trust_pickles=True)
        # Read here alone, whatever the process group; committed checkpoints only.
        read = dataclasses.replace(read, allow_stock=False, broadcast=False)
        reader = ObjectStoreReader(
            url, storage_options=self.storage_options, read=read, retry=self.retry
        )
        try:
            state = load_everything(reader)
        except CheckpointException as exc:
            # Loaded alone, so torch's wrapper carries this rank's error only; in a process
            # group the reader keeps an open error (not committed, not found) for DCP's
            # first step, and it would otherwise reach Lightning wrapped.
            cause = unwrap(exc)
            if cause is exc:
                raise
            raise cause from exc
        return _int_keyed_optimizer_state(state)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path`` (its manifest first), once any save to it ended."""
        url = self._url(path)
        self._settle(url)
        delete_step(Location.parse(url, self.storage_options, self.retry))

    def teardown(self) -> None:
        """Wait for every in-flight save and free the workers; raise a failed save's error."""
        try:
            self._settle()
        finally:
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None


class WaitStaged(Callback):
    """Waits for :class:`ObjckptCheckpointIO`'s background copies before the weights change.

    Lightning calls ``save_checkpoint`` after a batch's optimizer step; with
    ``background_staging`` the copy then runs while the next batch loads and runs
    forward and backward, and this callback makes the optimizer step wait for it.
    Made by :meth:`ObjckptCheckpointIO.staging_callback`.
    """

    def __init__(
        self, io: ObjckptCheckpointIO, wait_at: Literal["optimizer_step", "batch_start"]
    ) -> None:
        if wait_at not in ("optimizer_step", "batch_start"):
            raise ConfigurationError(
                f"option wait_at={wait_at!r} is invalid: expected 'optimizer_step' or 'batch_start'"
            )
        self.io = io
        self.wait_at = wait_at

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.io._callback_attached = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.wait_at == "optimizer_step":
            self.io.wait_staged()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.wait_at == "batch_start":
            self.io.wait_staged()
