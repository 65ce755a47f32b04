"""Checkpoint metadata at 8 to 4,096 ranks: what each rank fetches and decodes on load.

No processes are started: the metadata of a row-sharded transformer (400 weight
tensors plus two optimizer moments each, every tensor split over W ranks, packed
into 64 MiB payload objects per rank) is built exactly as a W-rank save would
produce it, then encoded and decoded three ways in the same run:

* ``dcp``: torch DCP's ``.metadata`` pickle (what every stock reader rank unpickles);
* ``objckpt_v1``: objckpt's format-1 manifest (every chunk a JSON record, read by every
  rank), re-created here as the reference the issue measured;
* ``objckpt_v2``: format 2 (compact manifest + one index object per writing rank).
  A loading rank at the same world size fetches the manifest and its own index
  object; ``load_decode_s`` is what that rank spends turning them into DCP
  ``Metadata`` and item locations before the first payload byte.

Per-rank decode + planning (``plan``): the last rank's load of its own row shard of
every tensor, decoded and planned two ways in the same run: objckpt's reader and
``objckpt.LoadPlanner`` (chunks kept as runs, only the overlapping ones built), and
what a rank paid before it (every chunk built, then DCP's ``DefaultLoadPlanner``).
Both plans are checked equal. The local shards are given through DCP's checkpoint
protocol (``__create_chunk_list__``, what DTensor implements), so no process group
is needed. Rank 0's commit, before and after #27 item 2: :mod:`scale_commit`.
Usage: ``python bench/bench_scale.py [--worlds 8,64,256,1024] [--repeats 3] [--plan-from 1024]
[--commit-worlds 1024,2048,4096,8192]``; results in ``bench/results/scale-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import scale_commit
import smoke
import torch
from record import write_record
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import objckpt
from objckpt.format.dcp_json import StoredItem, encode_planner_data, encode_storage_meta
from objckpt.format.index import decode_index, decode_metadata, encode_metadata

log = logging.getLogger("bench")
MiB = 1024 * 1024
ROWS, COLS = 16384, 1024  # every tensor: 64 MiB of fp32, split by rows
OBJECT_SIZE = 64 * MiB
ATTEMPT = "6b0000000000beef"


def simulate(
    world: int, layers: int = 400
) -> tuple[Metadata, list[dict[MetadataIndex, StoredItem]]]:
    """DCP metadata and per-rank stored items of a W-rank save of the model."""
    fqns = [f"model.layers.{i}.weight" for i in range(layers)]
    fqns += [f"optim.state.{f}.{m}" for f in fqns[:layers] for m in ("exp_avg", "exp_avg_sq")]
    rows = -(-ROWS // world)
    props = TensorProperties(dtype=torch.float32)
    sd_md: dict[str, Any] = {}
    items: list[dict[MetadataIndex, StoredItem]] = [{} for _ in range(world)]
    for fqn in fqns:
        chunks = []
        for r in range(world):
            start = r * rows
            n = max(0, min(rows, ROWS - start))
            chunks.append(ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([n, COLS])))
        sd_md[fqn] = TensorStorageMetadata(props, torch.Size([ROWS, COLS]), chunks)
    sd_md["step"] = BytesStorageMetadata()
    for r in range(world):
        obj, used = 0, 0
        for fqn in fqns:
            chunk = sd_md[fqn].chunks[r]
            length = chunk.sizes[0] * COLS * 4 + 1100  # torch.save framing
            if used and used + length > OBJECT_SIZE:
                obj, used = obj + 1, 0
            items[r][MetadataIndex(fqn, chunk.offsets)] = StoredItem(
                f"__{r}_{obj}.{ATTEMPT}.distcp",
                used,
                length,
                f"{(r * 7919 + used) & 0xFFFFFFFF:08x}",
            )
            used += length
    items[0][MetadataIndex("step")] = StoredItem(f"__0_0.{ATTEMPT}.distcp", 0, 900, "0badc0de")
    planner = {fqn: tuple(fqn.split(".")) for fqn in sd_md}
    meta = Metadata(
        sd_md, planner_data=planner, storage_meta=StorageMeta("s3://b/run/step", ATTEMPT)
    )
    return meta, items


def v1_document(meta: Metadata, items: list[dict[MetadataIndex, StoredItem]]) -> dict[str, Any]:
    """Format 1's metadata section: every chunk and every stored item a record."""
    state: dict[str, Any] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = {
                "type": "tensor",
                "dtype": "float32",
                "requires_grad": False,
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            state[fqn] = {"type": "bytes"}
    storage = [
        {
            "fqn": index.fqn,
            "chunk_offset": None if index.offset is None else list(index.offset),
            "index": index.index,
            "key": item.relative_path,
            "offset": item.offset,
            "length": item.length,
            "crc32c": item.crc32c,
            "transforms": None,
        }
        for rank_items in items
        for index, item in rank_items.items()
    ]
    return {
        "version": "1.0.0",
        "state_dict": state,
        "storage": storage,
        "planner_data": encode_planner_data(meta.planner_data),
        "storage_meta": encode_storage_meta(meta.storage_meta),
    }


def object_list(items: list[dict[MetadataIndex, StoredItem]], extra: list[Any] = ()) -> list[Any]:
    """The manifest's ``objects``: one entry per payload (and index) object."""
    sizes: dict[str, int] = {}
    for rank_items in items:
        for it in rank_items.values():
            sizes[it.relative_path] = max(sizes.get(it.relative_path, 0), it.offset + it.length)
    out = [{"key": k, "size": n, "crc32c": "0123abcd"} for k, n in sorted(sizes.items())]
    return out + [{"key": s.key, "size": len(s.data), "crc32c": "0123abcd"} for s in extra]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class LocalShard(torch.Tensor):
    """A rank's row shard as a load planner sees it (DCP's ``__create_chunk_list__``
    and the global ``size()``, as DTensor gives them), without a process group."""

    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, start: int, rows: int) -> LocalShard:
        shard = torch.Tensor._make_subclass(cls, torch.empty(0))
        shard._chunk = ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([rows, COLS]))
        return shard

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        full = torch.Size([ROWS, COLS])
        return full if dim is None else full[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]


def local_state(meta: Metadata, world: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state dict at ``world`` ranks: its row shard of every tensor."""
    rows = -(-ROWS // world)
    start = rank * rows
    n = max(0, min(rows, ROWS - start))
    state: dict[str, Any] = {
        fqn: LocalShard(start, n)
        for fqn, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    state["step"] = 0
    return state


def _plan(planner: Any, state: dict[str, Any], md: Metadata) -> list[Any]:
    planner.set_up_planner(state, md, is_coordinator=False)
    items = planner.create_local_plan().items
    return sorted((r.storage_index.fqn, r.storage_index.index, tuple(r.lengths)) for r in items)


def measure_plan(world: int, repeats: int, manifest: bytes, own: Any) -> dict[str, Any]:
    """The last rank's decode + plan, objckpt's way and the way before it."""
    rank = world - 1

    def decode() -> Metadata:
        doc = json.loads(manifest)["metadata"]
        decoded, _locator = decode_metadata(doc, url="s3://b/run/step")
        decode_index(own.data, rank=own.rank, attempt=ATTEMPT, metadata=decoded, url="x")
        return decoded

    def ours() -> list[Any]:
        md = decode()
        return _plan(objckpt.LoadPlanner(), local_state(md, world, rank), md)

    def before() -> list[Any]:
        md = decode()
        for tmd in md.state_dict_metadata.values():  # every chunk built, as before
            if isinstance(tmd, TensorStorageMetadata):
                tmd.chunks = list(tmd.chunks)
        return _plan(DefaultLoadPlanner(), local_state(md, world, rank), md)

    ours_s, ours_plan = timed(ours, repeats)
    before_s, before_plan = timed(before, repeats)
    if ours_plan != before_plan:
        raise AssertionError(f"W={world}: objckpt.LoadPlanner's reads differ from DCP's")
    decode_s, _ = timed(decode, repeats)
    return {
        "rank": rank,
        "reads": len(ours_plan),
        "decode_s": decode_s,
        "objckpt_decode_plan_s": ours_s,
        "default_decode_plan_s": before_s,
    }


def measure(
    world: int, repeats: int, with_dcp: bool, with_plan: bool = False, layers: int = 400
) -> dict[str, Any]:
    meta, items = simulate(world, layers)
    row: dict[str, Any] = {"world": world, "chunks": sum(len(i) for i in items)}
    if with_dcp:
        stock = Metadata(
            meta.state_dict_metadata,
            planner_data=meta.planner_data,
            storage_data={
                idx: _StorageInfo(it.relative_path, it.offset, it.length)
                for rank_items in items
                for idx, it in rank_items.items()
            },
            storage_meta=meta.storage_meta,
        )
        enc, blob = timed(lambda: pickle.dumps(stock), repeats)
        dec, _ = timed(lambda: pickle.loads(blob), repeats)
        row["dcp"] = {
            "bytes": len(blob),
            "encode_s": enc,
            "per_rank_fetch": len(blob),
            "decode_s": dec,
        }
        del stock, blob
        v1 = {"objects": object_list(items), "metadata": v1_document(meta, items)}
        enc, blob = timed(lambda: json.dumps(v1, separators=(",", ":")).encode(), repeats)
        dec, _ = timed(lambda: json.loads(blob), repeats)
        row["objckpt_v1"] = {
            "bytes": len(blob),
            "encode_s": enc,
            "per_rank_fetch": len(blob),
            "decode_s_json_only": dec,
        }
        del v1, blob

    def encode() -> tuple[bytes, list[Any]]:
        doc, shards = encode_metadata(meta, items, ATTEMPT)
        whole = {"objects": object_list(items, shards), "metadata": doc}
        return json.dumps(whole, separators=(",", ":")).encode(), shards

    enc, (manifest, shards) = timed(encode, repeats)
    own = next(s for s in shards if s.rank == world - 1)  # a rank other than the coordinator

    def load_on_one_rank() -> int:
        doc = json.loads(manifest)["metadata"]
        decoded, _locator = decode_metadata(doc, url="s3://b/run/step")
        found = decode_index(own.data, rank=own.rank, attempt=ATTEMPT, metadata=decoded, url="x")
        return len(found)

    dec, found = timed(load_on_one_rank, repeats)
    assert found == len(items[world - 1]), (found, len(items[world - 1]))
    index_bytes = sum(len(s.data) for s in shards)
    row["objckpt_v2"] = {
        "manifest_bytes": len(manifest),
        "index_bytes": index_bytes,
        "bytes": len(manifest) + index_bytes,
        "encode_s": enc,
        "per_rank_fetch": len(manifest) + len(own.data),
        "load_decode_s": dec,
    }
    if with_plan:
        del meta, items
        gc.collect()
        row["plan"] = measure_plan(world, repeats, manifest, own)
    return row


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| W | DCP `.metadata` | DCP unpickle | objckpt v1 manifest | v2 manifest + index "
        "(vs DCP) | v2 encode, rank 0 | v2 fetched per rank (vs v1) | v2 decode per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v2, dcp, v1 = r["objckpt_v2"], r.get("dcp"), r.get("objckpt_v1")
        cells = [str(r["world"])]
        cells += [_mb(dcp["bytes"]), f"{dcp['decode_s']:.2f} s"] if dcp else ["-", "-"]
        cells.append(_mb(v1["bytes"]) if v1 else "-")
        ratio = f" ({v2['bytes'] / dcp['bytes']:.2f}x)" if dcp else ""
        cells.append(_mb(v2["bytes"]) + ratio)
        cells.append(f"{v2['encode_s']:.2f} s")
        fetched = f" ({v2['per_rank_fetch'] / v1['per_rank_fetch']:.4f}x)" if v1 else ""
        cells.append(_mb(v2["per_rank_fetch"]) + fetched)
        cells.append(f"{v2['load_decode_s']:.2f} s")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| W | reads | decode + plan, objckpt.LoadPlanner | decode + plan, before "
        "(every chunk + DefaultLoadPlanner) | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("plan")
        if p:
            ours, before = p["objckpt_decode_plan_s"], p["default_decode_plan_s"]
            lines.append(
                f"| {r['world']} | {p['reads']} | {ours:.3f} s | {before:.2f} s "
                f"| {before / ours:.0f}x |"
            )
    return "\n".join(lines)


def real_save(tensors: int = 3000) -> dict[str, Any]:
    """A real W=1 save of ``tensors`` small tensors: manifest + index vs ``.metadata``."""
    import glob
    import os
    import tempfile

    import torch.distributed.checkpoint as dcp

    import objckpt

    state = {f"layers.{i // 10}.p{i % 10}": torch.randn(64) for i in range(tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(f"file://{tmp}/c"), no_dist=True)
        manifest = os.path.getsize(f"{tmp}/c/manifest.json")
        index = sum(os.path.getsize(p) for p in glob.glob(f"{tmp}/c/__index_*"))
        stock = os.path.getsize(f"{tmp}/c/.metadata")
    return {"tensors": tensors, "manifest": manifest, "index": index, "dcp_metadata": stock}


def restore_plan(world: int, per_node: int = 8, per_rank: int = 5) -> dict[str, Any]:
    """Rank 0's restore planning with peer replicas (``replicas=2``) at ``world``
    simulated ranks, one node lost: each node's tier holds its ranks' objects
    (``per_rank`` a rank) and node - 1's; one rank per node lists it and the node's
    ranks share that listing (:meth:`objckpt.ops.run.restore.Restorer._node_listings`);
    the check that every object is held somewhere and on enough nodes, as
    :func:`objckpt.ops.run.restore_plan.decide` makes it
    (:func:`objckpt.ops.run.restore_plan.holders_of`), beside the per-object scan of every
    rank's listing that it replaced. Bytes: what rank 0 reads (each node's listing
    once, from the c10d store, and the gather of one digest a rank, padded by torch to
    the largest answer), beside the gather of every rank's listing it replaced."""

    from objckpt.ops.run.restore_plan import holders_of
    from objckpt.ops.tier.peers import Holdings

    step = 2
    nodes = world // per_node
    node_of = [r // per_node for r in range(world)]
    own = {r: {f"__{r}_{i}.a.distcp": 1 << 20 for i in range(per_rank)} for r in range(world)}
    listings = []
    for node in range(nodes):
        held: dict[str, int] = {}
        if node != 1:  # node 1 lost: a replacement, empty
            for r in range(per_node):
                held.update(own[node * per_node + r])
                held.update(own[((node - 1) % nodes) * per_node + r])  # node - 1's files here
        listings.append(Holdings(f"/tier/node{node}", {step: held}, {}))
    views = [listings[node_of[r]] for r in range(world)]
    objects = [(k, n) for r in range(world) for k, n in own[r].items()]
    started = time.perf_counter()
    where = holders_of(step, views)
    lost = [k for k, n in objects if not where.get((k, n))]
    thin = any(len({node_of[h] for h in where.get((k, n), ())}) < 2 for k, n in objects)
    seconds = time.perf_counter() - started
    scan = min(world, 1024)  # the old scan is quadratic: timed on a prefix, scaled
    started = time.perf_counter()
    for k, n in objects[: scan * per_rank]:
        any(v.objects.get(step, {}).get(k) == n for v in views)
        {node_of[h] for h, v in enumerate(views) if v.objects.get(step, {}).get(k) == n}
    scan_seconds = (time.perf_counter() - started) * world / scan
    listing_bytes = [len(pickle.dumps((v, {step: "0" * 64}))) for v in listings]
    answer = len(pickle.dumps(("0" * 64, [])))  # a rank's answer in the gather
    return {
        "world": world,
        "seconds": seconds,
        "scan_seconds": scan_seconds,
        "gathered_bytes": sum(listing_bytes) + answer * world,
        "per_rank_listing_bytes": sum(listing_bytes[node_of[r]] for r in range(world)),
        "per_rank_padded_bytes": max(listing_bytes) * world,
        "lost": len(lost),
        "thin": thin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dcp-up-to", type=int, default=1024, help="largest W that also measures DCP and v1"
    )
    parser.add_argument(
        "--plan-from", type=int, default=1024, help="smallest W that also measures planning"
    )
    scale_commit.add_arguments(parser)
    parser.add_argument("--name", default="scale", help="result file name prefix")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--layers", type=int, default=400, help="weight tensors of the model")
    parser.add_argument("--real-tensors", type=int, default=3000, help="tensors of the W=1 save")
    parser.add_argument(
        "--restore-worlds",
        default="",
        help="W values at which to time rank 0's restore planning with peer replicas",
    )
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Smoke: every row kind once (DCP and v1, planning, rank 0's commit at W=64 the old
    # way and the new, DCP's global plan) on a model of a few layers.
    smoke.apply(
        args,
        worlds="8",
        repeats=1,
        plan_from=8,
        commit_worlds="64",
        layers=8,
        real_tensors=100,
        restore_worlds="64",
        plan_memory_worlds="64",
    )
    rows = []
    for world in (int(w) for w in args.worlds.split(",") if w):
        log.info("W=%d ...", world)
        rows.append(
            measure(
                world, args.repeats, world <= args.dcp_up_to, world >= args.plan_from, args.layers
            )
        )
        log.info("%s", json.dumps(rows[-1]))
    commits = scale_commit.run(
        args.commit_worlds,
        args.commit_before_up_to,
        functools.partial(simulate, layers=args.layers),
        args.commit_dcp_plan_up_to,
    )
    plan_memory = scale_commit.plan_memory(
        args.plan_memory_worlds, functools.partial(simulate, layers=args.layers)
    )
    restores = [restore_plan(int(w)) for w in args.restore_worlds.split(",") if w]
    real = real_save(args.real_tensors)
    fields = {
        "repeats": args.repeats,
        "rows": rows,
        "real_w1": real,
        "commit": commits,
        "plan_memory": plan_memory,
        "restore": restores,
    }
    path = write_record(args.out, args.name, 0, fields)
    print(table(rows) if rows else "")
    print("\n" + plan_table(rows) if any("plan" in r for r in rows) else "")
    print("\n" + scale_commit.commit_table(commits) if commits else "")
    print("\n" + scale_commit.publish_table(commits) if commits else "")
    ours = real["manifest"] + real["index"]
    print(
        f"\nreal W=1 save of {real['tensors']} tensors: manifest + index {ours / 1e3:.0f} kB, "
        f"DCP .metadata {real['dcp_metadata'] / 1e3:.0f} kB ({ours / real['dcp_metadata']:.2f}x)"
    )
    for r in plan_memory:
        kept = r["kept"]
        print(
            f"\nplan cache at W={r['world']}: DCP's global Metadata is {r['objects']:,} objects "
            f"({r['gc_tracked']:,} tracked by the garbage collector), {r['bytes'] / 2**30:.2f} "
            f"GiB; the plan kept once its layout is built ({r['layout_cpu_s']:.2f} CPU-s) is "
            f"{kept['objects']:,} objects ({kept['gc_tracked']:,} tracked), "
            f"{kept['bytes'] / 2**20:.1f} MiB"
        )
    for r in restores:
        print(
            f"\nrestore planning at W={r['world']}: {r['seconds']:.3f} s "
            f"(the per-object scan of every rank: {r['scan_seconds']:.3f} s); "
            f"rank 0 reads {r['gathered_bytes'] / 1e6:.2f} MB of holdings (one listing a "
            f"node); a listing from every rank was {r['per_rank_listing_bytes'] / 1e6:.1f} MB, "
            f"{r['per_rank_padded_bytes'] / 1e6:.1f} MB padded to the largest"
        )
    print(f"\nrecorded in {path}")


if __name__ == "__main__":
    main()
