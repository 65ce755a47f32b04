"""``LoadPlanner``: DCP's default load planner, finding overlaps from the runs.

DCP's :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` finds the stored
chunks a rank's shard overlaps by walking every chunk of every tensor: tensors x W
chunk objects per rank, each built by the reader first. At 4,096 ranks that is
most of a load's planning time, and it grows faster than W. objckpt's reader
hands out a format-2 tensor's chunks as runs
(:class:`~objckpt.format.chunk_runs.ChunkRuns`), and this planner asks them for
the chunks overlapping each local shard directly, building only those.

Everything else is DCP's own: flattening, the missing-key and size checks, the
read items (built by DCP's own helpers from the same chunks), the global plan, and
``resolve_tensor``/``load_bytes``. A tensor whose chunks are a plain list (a stock
DCP checkpoint, format 1) is planned by DCP's own code, so the plans are the ones
``DefaultLoadPlanner`` makes, in another order. DCP's helpers are private
(:func:`objckpt._torch.load_plan_helpers`); on a torch without them this planner
plans with ``DefaultLoadPlanner``'s own code.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from objckpt._torch import LoadPlanHelpers, load_plan_helpers
from objckpt.format.chunk_runs import ChunkRuns

__all__ = ["LoadPlanner"]


class LoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` whose per-rank planning does not grow with the world size.

    ``CheckpointManager.load`` uses it; pass it to a plain ``dcp.load`` with objckpt's
    reader for the same effect, as ``dcp.load(state_dict, storage_reader=reader,
    planner=objckpt.LoadPlanner())`` (with any other reader it plans as DCP's does).

    Args:
        flatten_state_dict: As ``DefaultLoadPlanner``'s.
        flatten_sharded_tensors: As ``DefaultLoadPlanner``'s.
        allow_partial_load: As ``DefaultLoadPlanner``'s: load what the checkpoint
            has and leave the rest of ``state_dict`` as it is.
    """

    def create_local_plan(self) -> LoadPlan:
        """This rank's reads: DCP's ``create_local_plan`` with the overlap search
        done on the runs."""
        if self.metadata is None:
            raise AssertionError("set_up_planner was not called with metadata")
        helpers = load_plan_helpers()
        if helpers is None:  # pragma: no cover - a torch without DCP's helpers
            return super().create_local_plan()
        if self.flatten_state_dict:
            # As DefaultLoadPlanner (torch 2.13): keys missing from the state dict may
            # be a checkpoint saved before torch 2.4, flattened the old way.
            missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
            if missing:
                old_state_dict, old_mappings = helpers.flatten_as_torch_2_3(
                    self.original_state_dict
                )
                if set(old_state_dict) & missing:
                    self.state_dict, self.mappings = old_state_dict, old_mappings
        return local_load_plan(
            self.state_dict, self.metadata, helpers, strict=not self.allow_partial_load
        )


def local_load_plan(
    state_dict: dict[str, Any], metadata: Metadata, helpers: LoadPlanHelpers, *, strict: bool
) -> LoadPlan:
    """DCP's ``create_default_local_load_plan``, same checks and messages, with the
    reads of a tensor stored as runs found by :func:`read_items_from_runs`."""
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = metadata.state_dict_metadata[fqn]
        if (
            isinstance(md, TensorStorageMetadata)
            and getattr(obj, "size", None) is not None
            and md.size != obj.size()
        ):
            raise ValueError(
                f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}",
            )
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is not in the tensor's mesh
        if isinstance(md, TensorStorageMetadata) and isinstance(md.chunks, ChunkRuns):
            requests += read_items_from_runs(fqn, md.chunks, obj, helpers)
        else:
            requests += helpers.create_read_items(fqn, md, obj)
    return LoadPlan(requests)


def read_items_from_runs(
    fqn: str, chunks: ChunkRuns, obj: Any, helpers: LoadPlanHelpers
) -> list[ReadItem]:
    """The reads filling ``obj``'s local chunks from the stored ``chunks`` they
    overlap: the items DCP's ``create_read_items_for_chunk_list`` makes, building
    only the stored chunks that overlap."""
    try:
        local_chunks = helpers.create_chunk_list(obj)
    except ValueError as ex:
        raise ValueError(
            f"Invalid checkpoint metadata for {fqn}, "
            f"expected BytesStorageMetadata but found {TensorStorageMetadata}",
        ) from ex
    items: list[ReadItem] = []
    for local_idx, local in enumerate(local_chunks):
        for storage_idx in chunks.overlapping(local.offsets, local.sizes):
            stored = chunks[storage_idx]
            narrows = helpers.overlap_region(saved_shard=stored, current_shard=local)
            items.append(
                helpers.create_read_item_for_tensor(
                    dest_index=MetadataIndex(fqn, local.offsets, local_idx),
                    dest_offsets=[n[2] for n in narrows],
                    storage_index=MetadataIndex(fqn, stored.offsets, storage_idx),
                    storage_offsets=[n[1] for n in narrows],
                    lengths=[n[3] for n in narrows],
                )
            )
    return items
