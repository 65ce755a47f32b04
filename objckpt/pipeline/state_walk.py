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


def _mesh_id(mesh: Any, meshes: dict[int, tuple[Any, Hashable]]) -> Hashable:
    """The mesh's ranks, shape and device type, computed once per mesh and scan (an
    FSDP state dict has thousands of DTensors on one mesh; each id is a torch call).
    The memo keeps each mesh it names, so no id is reused within the scan."""
    known = meshes.get(id(mesh))
    if known is None:
        key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.device_type)
        known = meshes[id(mesh)] = (mesh, key)
    return known[1]


def scan(state: Any) -> tuple[tuple[Hashable, ...], list[torch.Tensor], list[str]]:
    """One walk over a state dict: its layout (hashable, values excluded), its
    tensors in traversal order (DTensors as their local shards) and their paths.

    The layout is everything DCP's plan depends on, so equal layouts plan alike:
    paths, types, shapes, dtypes, devices, and for DTensors the global shape,
    placements and mesh.

    The layout is one flat tuple: each value's path and type, then what that type
    adds (a tensor: its dimensions, sizes, dtype and device, and a DTensor its global
    shape, placements and mesh; a list or tuple: its length). The type says how many
    fields follow it, so two different state dicts never flatten alike. Flat, because
    a tuple per tensor (and the ``torch.Size`` in it) is two objects the garbage
    collector tracks per tensor per save: at 10,000 tensors they set off ~28
    young-generation collections inside ``save()``, and, kept as the staging set's
    key, they fed the full collections that landed in the stall (#47).
    """
    layout: list[Any] = []  # hashable values (types, sizes, dtypes, devices)
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    _scan(state, "", layout, tensors, paths, {})
    return tuple(layout), tensors, paths


# The walks are module-level functions, not closures: a recursive closure is a
# reference cycle (the function's cell holds the function), which would keep what it
# closes over (the staged views) alive until a garbage collection.
def _scan(
    value: Any,
    path: str,
    layout: list[Any],
    tensors: list[torch.Tensor],
    paths: list[str],
    meshes: dict[int, tuple[Any, Hashable]],
) -> None:
    kind = type(value)
    if kind in _PLAIN and value.layout is torch.strided and not value.is_meta:
        # The common case, a plain dense tensor, with the fewest reads: the scan runs
        # on the training thread for every tensor of every save.
        shape = value.shape
        layout.extend((path, kind, len(shape), *shape, value.dtype, value.device))
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
        shape = t.shape
        layout.extend((path, kind, len(shape), *shape, t.dtype, t.device))
        if local is not None:  # where the shard sits in the global tensor
            dt = cast(Any, value)
            whole = value.shape
            layout.extend((len(whole), *whole, str(dt.placements)))
            layout.append(_mesh_id(dt.device_mesh, meshes))
        tensors.append(t)
        paths.append(path)
    elif isinstance(value, dict):
        layout.extend((path, kind, len(value)))
        for k, v in value.items():
            sub = f"{path}.{k}"
            if type(v) in _PLAIN and v.layout is torch.strided and not v.is_meta:
                # the fast case above, inlined: a call per entry costs as much
                shape = v.shape
                layout.extend((sub, type(v), len(shape), *shape, v.dtype, v.device))
                tensors.append(v)
                paths.append(sub)
            else:
                _scan(v, sub, layout, tensors, paths, meshes)
    elif isinstance(value, (list, tuple)):
        layout.extend((path, kind, len(value)))
        for i, v in enumerate(value):
            _scan(v, f"{path}[{i}]", layout, tensors, paths, meshes)
    else:
        layout.extend((path, kind))


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
