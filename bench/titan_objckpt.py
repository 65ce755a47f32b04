"""torchtitan 0.3.0 saving and resuming through objckpt: the module a user writes.

docs/guides/torchtitan.md shows this file; bench/titan_run.py and
tests/integrations/test_torchtitan.py run it. torchtitan builds its checkpoint manager from
``Trainer.Config.checkpoint`` (``config.checkpoint.build(...)``), so a subclass of its
``CheckpointManager`` with its own nested ``Config``, set in a config function, is
the whole change: no torchtitan patch, no objckpt change.

    torchrun --nproc_per_node=8 -m torchtitan.train \
        --module titan_objckpt --config llama3_debugmodel_objckpt \
        --checkpoint.enable --checkpoint.folder s3://bucket/run-1/checkpoint
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import fsspec
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer import MODEL
from torchtitan.models.llama3.config_registry import llama3_debugmodel

import objckpt


class ObjckptCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with DCP's storage replaced by objckpt's."""

    #: s3fs/gcsfs/adlfs options; empty: endpoint and credentials from the environment
    storage_options: ClassVar[dict[str, Any]] = {}

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # torchtitan builds the class that declares it
        pass

    def dcp_save(
        self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False
    ):
        if to_hf:  # the HF safetensors export stays torchtitan's (local folders only)
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = objckpt.ObjectStoreWriter(checkpoint_id, storage_options=self.storage_options)
        if async_mode == AsyncMode.ASYNC:  # torchtitan waits on the Future it returns
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        if async_mode != AsyncMode.DISABLED:
            raise ValueError(f"checkpoint.async_mode={async_mode.value}: use disabled or async")
        dcp.save(state_dict, storage_writer=writer)
        return None

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = objckpt.ObjectStoreReader(checkpoint_id, storage_options=self.storage_options)
        dcp.load(state_dict, storage_reader=reader)
        self.states[MODEL].load_state_dict(state_dict)  # what torchtitan's dcp_load does
        return None

    def _find_load_step(self, folder: str = "") -> int:
        # The newest *committed* step: objckpt writes manifest.json last, as its commit;
        # torchtitan's own test (.metadata exists) also passes a step still uploading.
        fs, root = fsspec.core.url_to_fs(folder or self.folder, **self.storage_options)
        fs.invalidate_cache(root)
        if not fs.isdir(root):
            return -1
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        steps = sorted(
            (int(m[1]) for n in names if (m := re.fullmatch(r"step-(\d+)", n))), reverse=True
        )
        return next((s for s in steps if fs.exists(f"{root}/step-{s}/manifest.json")), -1)


def llama3_debugmodel_objckpt():
    """torchtitan's ``llama3_debugmodel``, checkpointing through objckpt."""
    config = llama3_debugmodel()
    config.checkpoint = ObjckptCheckpointManager.Config(
        **{
            f.name: getattr(config.checkpoint, f.name)
            for f in dataclasses.fields(CheckpointManager.Config)
        }
    )
    return config
