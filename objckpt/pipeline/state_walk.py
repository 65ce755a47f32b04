"""Walking a state dict: its layout and tensors out, staged views back in.

Staging needs two passes over the caller's nested dicts, lists and tuples, and
both must visit tensors in the same order: :func:`scan` collects the tensors
(DTensors as their local shards) and a hashable layout that says whether a
previous save's staging set and plan still fit; :func:`rebuild` puts the staged
views back where the tensors were (re-wrapping DTensor shards), giving the state
dict DCP plans and writes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any, cast

import torch

from objckpt.errors import StateDictError

__all__ = ["rebuild", "scan"]


#: Types that are never DTensors (the common case, decided without attribute lookups).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_local(value: torch.Tensor) -> torch.Tensor | None:
    if type(value) in _PLAIN:
        return None
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) and hasattr(value, "device_mesh") else None


def _mesh_id(mesh: Any) -> Hashable:
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.device_type)


def scan(state: Any) -> tuple[tuple[Hashable, ...], list[torch.Tensor], list[str]]:
    """One walk over a state dict: its layout (hashable, values excluded), its
    tensors in traversal order (DTensors as their local shards) and their paths.

    The layout is everything DCP's plan depends on, so equal layouts plan alike:
    paths, types, shapes, dtypes, devices, and for DTensors the global shape,
    placements and mesh.
    """
    layout: list[Hashable] = []
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    _scan(state, "", layout, tensors, paths)
    return tuple(layout), tensors, paths


# The walks are module-level functions, not closures: a recursive closure is a
# reference cycle (the function's cell holds the function), which would keep what it
# closes over (the staged views) alive until a garbage collection.
def _scan(
    value: Any, path: str, layout: list[Hashable], tensors: list[torch.Tensor], paths: list[str]
) -> None:
    if type(value) in _PLAIN and value.layout is torch.strided and not value.is_meta:
        # The common case, a plain dense tensor, with the fewest reads: the scan runs
        # on the training thread for every tensor of every save (torch.Size hashes
        # and compares as the tuple of its sizes).
        layout.append((path, type(value).__name__, value.shape, value.dtype, value.device))
        tensors.append(value)
        paths.append(path)
    elif isinstance(value, torch.Tensor):
        if callable(getattr(value, "local_shards", None)):
            # its wrapper answers no tensor query (is_meta, layout) once a rank
            # holds two shards; refused here rather than failing inside torch
            raise StateDictError(
                f"state-dict entry {path.lstrip('.')!r} is a ShardedTensor, which async "
                "save does not stage; save it with dcp.save and objckpt.ObjectStoreWriter, "
                "or use a DTensor"
            )
        local = _dtensor_local(value)
        if local is None and value.layout != torch.strided:
            raise StateDictError(
                f"state-dict entry {path.lstrip('.')!r} is a {value.layout} tensor, "
                "which async save does not support; convert it (e.g. .to_dense())"
            )
        if value.is_meta:
            raise StateDictError(
                f"state-dict entry {path.lstrip('.')!r} is a meta tensor (it has no data); "
                "materialize it before saving"
            )
        t = value if local is None else local
        entry: tuple[Hashable, ...] = (
            path,
            type(value).__name__,
            tuple(t.shape),
            t.dtype,
            t.device,
        )
        if local is not None:  # where the shard sits in the global tensor
            dt = cast(Any, value)
            entry += (tuple(value.shape), str(dt.placements), _mesh_id(dt.device_mesh))
        layout.append(entry)
        tensors.append(t)
        paths.append(path)
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}"
            if type(v) in _PLAIN and v.layout is torch.strided and not v.is_meta:
                # the fast case above, inlined: a call per entry costs as much
                layout.append((sub, type(v).__name__, v.shape, v.dtype, v.device))
                tensors.append(v)
                paths.append(sub)
            else:
                _scan(v, sub, layout, tensors, paths)
    elif isinstance(value, (list, tuple)):
        layout.append((path, type(value).__name__, len(value)))
        for i, v in enumerate(value):
            _scan(v, f"{path}[{i}]", layout, tensors, paths)
    else:
        layout.append((path, type(value).__name__))


def rebuild(state: Any, views: list[torch.Tensor]) -> Any:
    """``state`` with each tensor replaced by its staged view, in traversal order."""
    return _rebuild(state, iter(views))


def _rebuild(value: Any, views: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        view = next(views)
        if _dtensor_local(value) is None:
            return view
        from torch.distributed.tensor import DTensor

        dt = cast(Any, value)
        return DTensor.from_local(
            view,
            dt.device_mesh,
            dt.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, dict):  # a plain tensor's view inline, as in the scan
        return {
            k: next(views) if type(v) in _PLAIN else _rebuild(v, views) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_rebuild(v, views) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, views) for v in value)
    return value
