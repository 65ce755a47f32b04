"""objckpt.LoadPlanner plans exactly what DCP's DefaultLoadPlanner plans.

The oracle is DCP's own planner on the metadata the save built (plain chunk lists):
for saves on 4 ranks in every sharding (rows, columns, a 2-D mesh, uneven cuts,
empty shards, replicated, 0-d, bytes) loaded at 2, 3 and 8 ranks in another
sharding, every rank's read items from objckpt's planner on the decoded manifest
(chunks kept as runs) must be the same set as DCP's. Local shards are given through
DCP's checkpoint protocol (``__create_chunk_list__``, what DTensor implements), so
no process group is needed; a real reshard through the manager on gloo ranks
against moto checks the bytes.
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
from typing import Any

import load_planner_ranks
import pytest
import torch
from ranks import run_ranks
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import objckpt
from objckpt.errors import ManifestError
from objckpt.format import columns
from objckpt.format.chunk_runs import ChunkRuns
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_metadata, encode_metadata
from objckpt.testing.plugin import StoreTarget

ATTEMPT = "6b0000000000beef"
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


# -- layouts -------------------------------------------------------------------------------
def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """DTensor's Shard(dim) cut: ceil(n / parts) each, the last ones short or empty
    (an empty shard sits at the end of the dimension)."""
    per = -(-n // parts)
    return [(min(i * per, n), max(0, min(per, n - i * per))) for i in range(parts)]


def _cuts(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """Uneven cuts at random points (some shards empty)."""
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    edges = [0, *points, n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def layout(kind: str, shape: tuple[int, ...], world: int, seed: int = 0) -> list[list[Box]]:
    """Each rank's boxes of a tensor of ``shape`` sharded ``kind`` over ``world`` ranks."""
    rng = random.Random(f"{kind}-{shape}-{world}-{seed}")
    full = (tuple(0 for _ in shape), tuple(shape))
    if kind == "replicated" or not shape:
        return [[full] for _ in range(world)]
    dims = [list(zip([0], [d], strict=True)) for d in shape]
    if kind == "rows":
        dims[0] = _split(shape[0], world)
    elif kind == "cols":
        dims[-1] = _split(shape[-1], world)
    elif kind == "uneven":
        dims[0] = _cuts(shape[0], world, rng)
    elif kind in ("mesh", "mesh_uneven"):
        a = next(f for f in (2, 3, 1) if world % f == 0)
        cut = _cuts if kind == "mesh_uneven" else (lambda n, p, _r: _split(n, p))
        dims[0] = cut(shape[0], a, rng)
        dims[-1] = cut(shape[-1], world // a, rng)
    else:
        raise ValueError(kind)
    boxes = [
        (tuple(o for o, _ in pick), tuple(s for _, s in pick))
        for pick in _product(dims)  # row-major over the mesh: rank order
    ]
    if kind in ("rows", "cols", "uneven"):
        return [[b] for b in boxes]
    return [[b] for b in boxes[:world]] + [[] for _ in range(world - len(boxes))]


def _product(dims: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[]]
    for options in dims:
        out = [[*prefix, o] for prefix in out for o in options]
    return out


SHAPES = {"w": (66, 32), "emb": (40, 16), "b": (10,), "cube": (6, 5, 7), "scalar": ()}
KINDS = ["rows", "cols", "uneven", "mesh", "mesh_uneven", "replicated"]


def saved(kinds: dict[str, str], world: int) -> tuple[Metadata, list[dict[MetadataIndex, Any]]]:
    """The DCP metadata and per-rank items a ``world``-rank save of ``kinds`` builds
    (a replicated tensor is written once, by rank 0, as DCP's dedup does)."""
    sd: dict[str, Any] = {}
    items: list[dict[MetadataIndex, StoredItem]] = [{} for _ in range(world)]
    for fqn, shape in SHAPES.items():
        per_rank = layout(kinds.get(fqn, "rows"), shape, world)
        if kinds.get(fqn) == "replicated" or not shape:
            per_rank = [per_rank[0]] + [[] for _ in range(world - 1)]
        chunks = []
        for rank, boxes in enumerate(per_rank):
            for offsets, sizes in boxes:
                if any(tuple(c.offsets) == offsets for c in chunks):
                    continue  # empty shards at one place: DCP's dedup keeps one
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                chunks.append(chunk)
                items[rank][MetadataIndex(fqn, chunk.offsets)] = StoredItem(
                    f"__{rank}_0.{ATTEMPT}.distcp", 64 * len(chunks), 4, "0badc0de"
                )
        sd[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), chunks)
    sd["step"] = BytesStorageMetadata()
    items[0][MetadataIndex("step")] = StoredItem(f"__0_0.{ATTEMPT}.distcp", 0, 8, None)
    return Metadata(sd, planner_data={k: (k,) for k in sd}), items


def decoded(meta: Metadata, items: list[dict[MetadataIndex, Any]]) -> Metadata:
    """``meta`` as objckpt's reader hands it out: through the manifest's JSON."""
    doc, _ = encode_metadata(meta, items, ATTEMPT)
    out, _locator = decode_metadata(json.loads(json.dumps(doc)), url="s3://b/ckpt")
    return out


class Shard(torch.Tensor):
    """A rank's part of a tensor, described through DCP's checkpoint protocol (the
    ``__create_chunk_list__`` and global ``size()`` DTensor implements): what a load
    planner sees of it. A tensor subclass, since DCP drops any other leaf type."""

    _boxes: list[Box]
    _global: torch.Size

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], boxes: list[Box]) -> Shard:
        shard = torch.Tensor._make_subclass(cls, torch.empty(0))
        shard._global, shard._boxes = torch.Size(shape), boxes
        return shard

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        return self._global if dim is None else self._global[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in self._boxes]


def local_state(kinds: dict[str, str], world: int, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = {
        fqn: Shard(shape, layout(kinds.get(fqn, "rows"), shape, world, seed=1)[rank])
        for fqn, shape in SHAPES.items()
    }
    state["step"] = 0
    return state


def plan_of(planner: Any, state: dict[str, Any], metadata: Metadata) -> list[tuple[Any, ...]]:
    """A planner's read items for ``state``, as comparable tuples, sorted."""
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return sorted(
        (
            r.type.value,
            r.dest_index.fqn,
            tuple(r.dest_index.offset or ()),
            r.dest_index.index,
            tuple(r.dest_offsets),
            r.storage_index.fqn,
            tuple(r.storage_index.offset or ()),
            r.storage_index.index,
            tuple(r.storage_offsets),
            tuple(r.lengths),
        )
        for r in planner.create_local_plan().items
    )


# -- the oracle ----------------------------------------------------------------------------
CASES = [
    ({f: save for f in SHAPES}, {f: load for f in SHAPES}, world)
    for save in KINDS
    for load, world in (
        ("rows", 2),
        ("cols", 3),
        ("mesh", 8),
        ("uneven", 3),
        ("mesh_uneven", 8),
        ("replicated", 2),
        (save, 4),
    )
] + [
    (  # every tensor sharded its own way, both times
        dict(zip(SHAPES, ["mesh", "uneven", "cols", "mesh_uneven", "rows"], strict=True)),
        dict(zip(SHAPES, ["cols", "mesh", "uneven", "rows", "rows"], strict=True)),
        world,
    )
    for world in (2, 3, 8)
]


@pytest.mark.parametrize(("save", "load", "world"), CASES)
def test_reads_equal_dcps_default_planner(
    save: dict[str, str], load: dict[str, str], world: int
) -> None:
    meta, items = saved(save, 4)
    ours_md = decoded(meta, items)
    sharded = [f for f, kind in save.items() if kind != "replicated" and SHAPES[f]]
    for fqn in sharded:  # kept as runs; a tensor saved whole is one plain chunk
        assert isinstance(ours_md.state_dict_metadata[fqn].chunks, ChunkRuns), fqn
    for rank in range(world):
        expected = plan_of(DefaultLoadPlanner(), local_state(load, world, rank), meta)
        assert expected, (save, load, world, rank)  # every rank reads something
        got = plan_of(objckpt.LoadPlanner(), local_state(load, world, rank), ours_md)
        assert got == expected, (save, load, world, rank)
        # Interop: DCP's own planner on what objckpt's reader hands out.
        stock = plan_of(DefaultLoadPlanner(), local_state(load, world, rank), ours_md)
        assert stock == expected, (save, load, world, rank)


def test_plain_tensors_read_every_chunk_and_missing_keys_and_sizes_fail_as_dcps() -> None:
    meta, items = saved({f: "mesh_uneven" for f in SHAPES}, 4)
    ours_md = decoded(meta, items)
    whole: dict[str, Any] = {f: torch.zeros(s) for f, s in SHAPES.items()} | {"step": 0}
    assert plan_of(objckpt.LoadPlanner(), whole, ours_md) == plan_of(
        DefaultLoadPlanner(), whole, meta
    )
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: extra"):
        plan_of(objckpt.LoadPlanner(), whole | {"extra": torch.zeros(1)}, ours_md)
    partial = plan_of(
        objckpt.LoadPlanner(allow_partial_load=True), whole | {"extra": torch.zeros(1)}, ours_md
    )
    assert partial == plan_of(DefaultLoadPlanner(), whole, meta)
    with pytest.raises(ValueError, match=r"Size mismatch between saved .* for w"):
        plan_of(objckpt.LoadPlanner(), whole | {"w": torch.zeros(65, 32)}, ours_md)


# -- the runs themselves -------------------------------------------------------------------
def _random_column(rng: random.Random, n: int) -> list[int]:
    values: list[int] = []
    while len(values) < n:
        start, step = rng.randint(-5, 40), rng.choice([0, 0, 1, 3, 7, -2])
        values += [start + step * k for k in range(min(n - len(values), rng.randint(1, 9)))]
    return values


@pytest.mark.parametrize("seed", range(30))
def test_overlapping_equals_dcps_pair_rule_on_random_runs(seed: int) -> None:
    """Arbitrary columns (negative steps, zero sizes, runs ending anywhere) against
    DCP's own overlap test, chunk by chunk."""
    from torch.distributed.checkpoint.resharding import _check_shard_metadata_pair_overlap

    rng = random.Random(seed)
    n, ndim = rng.randint(1, 60), rng.randint(1, 3)
    offs = [_random_column(rng, n) for _ in range(ndim)]
    sizes = [[abs(v) % 9 for v in _random_column(rng, n)] for _ in range(ndim)]
    runs = ChunkRuns(
        [columns.column(columns.pack(c), n, "o") for c in offs],
        [columns.column(columns.pack(c), n, "s") for c in sizes],
        n,
    )
    plain = [
        ChunkStorageMetadata(torch.Size(o), torch.Size(s))
        for o, s in zip(zip(*offs, strict=True), zip(*sizes, strict=True), strict=True)
    ]
    assert runs == plain and list(runs) == plain and len(runs) == n
    for _ in range(40):
        box = ChunkStorageMetadata(
            torch.Size(rng.randint(-3, 45) for _ in range(ndim)),
            torch.Size(rng.randint(0, 20) for _ in range(ndim)),
        )
        expected = [i for i, c in enumerate(plain) if _check_shard_metadata_pair_overlap(box, c)]
        assert runs.overlapping(box.offsets, box.sizes) == expected, (seed, box)


def test_chunk_runs_behave_as_the_list_they_stand_for() -> None:
    offs = columns.column({"runs": [0, 17, 3, 51, 0, 1]}, 4, "o")
    rows = columns.column({"runs": [17, 0, 3, 15, 0, 1]}, 4, "s")
    cols = columns.column([0, 0, 0, 0], 4, "o1")
    width = columns.column([32, 32, 32, 32], 4, "s1")
    runs = ChunkRuns([offs, cols], [rows, width], 4)
    plain = [
        ChunkStorageMetadata(torch.Size([o, 0]), torch.Size([s, 32]))
        for o, s in ((0, 17), (17, 17), (34, 17), (51, 15))
    ]
    assert runs[3] == runs[-1] == plain[3] and runs[1:3] == plain[1:3]
    assert plain == runs and runs == plain and runs != plain[:3]
    assert pickle.loads(pickle.dumps(runs)) == plain
    assert type(pickle.loads(pickle.dumps(runs))) is list
    with pytest.raises(IndexError, match="chunk 4 out of range for 4 chunks"):
        runs[4]
    assert list(offs) == [0, 17, 34, 51] and offs[-1] == 51 and len(offs) == 4
    assert list(ChunkRuns([], [], 3)) == [ChunkStorageMetadata(torch.Size(), torch.Size())] * 3


@pytest.mark.parametrize(
    ("doc", "length", "needle"),
    [
        ([1, 2, 3], 4, "3 values, expected 4"),
        ([1, "2"], 2, "integers"),
        ([1, True], 2, "integers"),
        ({"runs": [0, 1]}, 2, "triples"),
        ({"runs": [0, 1, 0]}, 0, "int>=1"),
        ({"runs": [0, 1, 10**12]}, 5, "more than 5"),
        ({"rows": [0, 1, 2]}, 2, "expected a list"),
        ("0,1,2", 3, "expected a list"),
    ],
)
def test_lazy_columns_refuse_what_unpack_refuses(doc: Any, length: int, needle: str) -> None:
    with pytest.raises(ManifestError, match="offsets") as info:
        columns.column(doc, length, "offsets")
    assert needle in str(info.value)


@pytest.mark.parametrize("seed", range(10))
def test_lazy_columns_hold_the_values_unpack_expands(seed: int) -> None:
    rng = random.Random(seed)
    values = _random_column(rng, rng.randint(1, 50))
    for doc in (values, columns.pack(values)):
        col = columns.column(doc, len(values), "c")
        assert list(col) == values == [col[i] for i in range(len(values))]
        assert col == columns.unpack(doc, len(values), "c")


# -- real ranks, real store ----------------------------------------------------------------
def _run(body: str, world: int, tmp_path: Any, url: str, options: dict[str, Any]) -> None:
    init_file = tmp_path / f"init-{body}-{world}"
    args = (body, world, str(init_file), url, options)
    run_ranks(load_planner_ranks, *args)


def test_manager_reshards_4_to_2_bit_exact(s3_bucket: StoreTarget, tmp_path: Any) -> None:
    """Saved by 4 gloo ranks through the manager (rows), loaded by 2 in another
    sharding (columns, and rows) through the manager, which plans with
    objckpt.LoadPlanner: every value bit-exact on every rank."""
    url = s3_bucket.url("reshard-planner")
    _run("save_rows", 4, tmp_path, url, s3_bucket.storage_options)
    _run("load_resharded", 2, tmp_path, url, s3_bucket.storage_options)
