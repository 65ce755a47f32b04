"""Rank 0's commit at W ranks, simulated: training-process CPU, c10d bytes, helper time.

Part of ``bench_scale.py`` (``--commit-worlds``). The W ranks' uploads are simulated
as ``bench_scale.simulate`` builds them (400 row-sharded weights and two optimizer
moments each, 64 MiB payload objects); what is measured is real code on a real c10d
``HashStore`` and a ``file://`` store in a temporary directory (no payload bytes:
``require_present`` is skipped for local stores, so no listing is counted):

(:func:`hint` gives each simulated item the chunk position DCP's global planner
writes into its index, which a rank's own index needs.)

* ``before``: the coordinator path as it was: every rank posts its pickled write
  results; rank 0 waits, gets, checks and deletes each rank's key, unpickles W
  results, then ``commit_checkpoint`` (encode and PUT W index objects, pickle
  ``.metadata``, the manifest), all in the training process.
* ``after``: every rank encodes and PUTs its own index and posts a
  :class:`~objckpt.format.commit.RankReport`; rank 0 gathers them
  (``RankExchange.gather``: one wait, one ``multi_get``) and commits with
  :class:`~objckpt.pipeline.coordinator.CommitHelper`, whose helper process renames
  the last ``.metadata`` before the manifest, or reads the W index objects and builds
  it after the manifest (the first save of a plan: the outcome is published before).
  Measured three times: the first save of a plan and a later one, both writing
  ``.metadata`` at every W (``stock_metadata_max_ranks=None``), and a third at the
  default limit (2,048 ranks: above it no ``.metadata``). A new plan's layout and
  writer columns (O(chunks)) are built by rank 0 while the uploads run, before the
  commit (``layout_cpu_s``, on the save's background thread); both commits find them
  kept.

Rank 0's figure is ``time.process_time()`` of the whole bench process over the
commit (every thread: the exchange, the manifest, pickling the helper's task and
reply), the helper's the CPU ``/proc`` reports for its process. c10d bytes per rank
are key + value of what the rank posts (the outcome it reads is one small key more).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from proc_stats import Collections
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from objckpt.format.commit import (
    GlobalPlan,
    RankReport,
    commit_checkpoint,
    requests_result,
    stock_digest,
    written_objects,
)
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import encode_rank_index
from objckpt.format.manifest import ObjectEntry
from objckpt.options import UploadOptions
from objckpt.pipeline.coordinator import CommitHelper
from objckpt.pipeline.finalize import RankExchange
from objckpt.writers import open_store
from objckpt.writers.accounting import RequestStats
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location

log = logging.getLogger("bench")
ATTEMPT = "6b0000000000beef"
#: The later save's attempt id (same length, as every attempt id is).
LATER = "6b0000000001cafe"
#: The third save's, at the default ``stock_metadata_max_ranks``.
THIRD = "6b0000000002d00d"
#: The first two saves write ``.metadata`` at every W (what every save did before the
#: limit); the third has the library's default.
EVERY = UploadOptions(stock_metadata_max_ranks=None)


def hint(items: list[dict[MetadataIndex, StoredItem]]) -> None:
    """Give each simulated item, in place, the chunk position DCP's global planner
    writes into its index (rank r holds chunk r of every tensor here), which a rank's
    own index needs, and its payload object's size."""
    for rank, rank_items in enumerate(items):
        ends: dict[str, int] = {}
        for it in rank_items.values():
            ends[it.relative_path] = max(ends.get(it.relative_path, 0), it.offset + it.length)
        items[rank] = {
            MetadataIndex(i.fqn, i.offset, None if i.offset is None else rank): dataclasses.replace(
                it, object_size=ends[it.relative_path], object_crc32c="0123abcd"
            )
            for i, it in rank_items.items()
        }


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_of(pid: int) -> int:
    """Peak resident bytes of process ``pid`` so far (Linux /proc ``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _results(items: dict[MetadataIndex, StoredItem]) -> list[WriteResult]:
    out = [WriteResult(index=i, size_in_bytes=s.length, storage_data=s) for i, s in items.items()]
    out.append(requests_result(RequestStats()))
    return out


def measure_before(meta: Any, items: list[dict[MetadataIndex, StoredItem]]) -> dict[str, Any]:
    """The coordinator path as it was (see module doc)."""
    world = len(items)
    store = dist.HashStore()
    posted = []
    for r in range(world):
        value = pickle.dumps((True, _results(items[r])))
        key = f"objckpt/{ATTEMPT}/rank{r}"
        posted.append(len(key) + len(value))
        store.set(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        target = open_store(Location.parse(f"file://{tmp}/before"), UploadOptions())
        gc.collect()
        t0, w0 = time.process_time(), time.perf_counter()
        keys = [f"objckpt/{ATTEMPT}/rank{r}" for r in range(world)]
        store.wait(keys)
        results = [pickle.loads(store.get(k))[1] for k in keys]
        for k in keys:
            store.check([k])
            store.delete_key(k)
        manifest = commit_checkpoint(
            target, meta, results, attempt=ATTEMPT, world_size=world, overwrite=False
        )
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        del results
        assert len(manifest.objects) > world
    return {
        "rank0_cpu_s": cpu,
        "rank0_wall_s": wall,
        "c10d_bytes_per_rank_max": max(posted),
        "c10d_bytes_per_rank_mean": sum(posted) / world,
    }


def measure_after(
    meta: Any, items: list[dict[MetadataIndex, StoredItem]], keep: bool = True
) -> dict[str, Any]:
    """Every rank's own index, rank 0's gather and commit with its helper (without
    ``keep``, ``items`` is emptied once the ranks' index objects are written: memory)."""
    world = len(items)
    row: dict[str, Any] = {"saves": []}
    tmp = tempfile.mkdtemp()
    helper = CommitHelper()
    try:
        helper.start()
        helper._submit(_noop).result()  # up, torch imported: its start is not a save's
        first = f"{tmp}/step0"
        os.makedirs(first)
        later = f"{tmp}/step1"
        os.makedirs(later)
        third = f"{tmp}/step2"
        os.makedirs(third)
        reports, renamed, thirds = [], [], []
        encode_s = digest_s = 0.0
        # What DCP's finish gives rank 0: each rank's placeholders naming its items,
        # which the plan's writer columns come from (#46).
        planned = [[WriteResult(i, 0, None) for i in items[r]] for r in range(world)]
        for r in range(world):
            t0 = time.process_time()
            shard = encode_rank_index(items[r], r, ATTEMPT)
            crc = Crc32c()
            crc.update(shard.data)
            spent = time.process_time() - t0
            t0 = time.process_time()
            digest = stock_digest(items[r], ATTEMPT, first)
            if r == world - 1:  # one rank other than the coordinator
                encode_s, digest_s = spent, time.process_time() - t0
            with open(f"{first}/{shard.key}", "wb") as f:
                f.write(shard.data)
            entry = ObjectEntry(shard.key, len(shard.data), crc.hexdigest())
            objects = written_objects(_results(items[r]))
            reports.append(RankReport(entry, objects, RequestStats(), digest))
            # The later saves: the same items under another attempt id (a rank's index
            # names its objects by it, and it is all that changes; same length).
            renamed.append(_renamed(shard.key, shard.data, objects, digest, later, LATER))
            thirds.append(_renamed(shard.key, shard.data, objects, digest, third, THIRD))
        if not keep:
            items.clear()
            gc.collect()
        row["rank_index_encode_s"] = encode_s
        row["rank_stock_digest_s"] = digest_s
        row["index_bytes_per_rank"] = reports[-1].index.size if reports[-1].index else 0
        # Rank 0 builds a new plan's layout on the save's background thread while the
        # uploads run (commit_phase); timed apart from the commit, which finds it kept.
        gc.collect()
        t0, w0 = time.process_time(), time.perf_counter()
        plan = GlobalPlan(meta, planned)
        del planned
        helper.prepare_layout(plan)
        row["layout_cpu_s"] = time.process_time() - t0
        assert not plan.holds_metadata, "no layout was built"
        row["layout_wall_s"] = time.perf_counter() - w0
        saves = (
            ("first save of the plan", reports, ATTEMPT, EVERY),
            ("later save", renamed, LATER, EVERY),
            ("later save, default options", thirds, THIRD, UploadOptions()),
        )
        for n, (label, sent, attempt, upload) in enumerate(saves):
            url_dir = f"{tmp}/step{n}"
            row["saves"].append(_one_save(helper, plan, sent, url_dir, label, attempt, upload))
        posted = row["saves"][0].pop("bytes")["posted"]
        for save in row["saves"][1:]:
            save.pop("bytes")
        row["c10d_bytes_per_rank_max"] = max(posted)
        row["c10d_bytes_per_rank_mean"] = sum(posted) / world
    finally:
        helper.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def _renamed(
    key: str, data: bytes, objects: Any, digest: str, directory: str, attempt: str
) -> RankReport:
    """A rank's index object of the first save under ``attempt``, written into
    ``directory``, and its report."""
    data = data.replace(ATTEMPT.encode(), attempt.encode())
    key = key.replace(ATTEMPT, attempt)
    with open(f"{directory}/{key}", "wb") as f:
        f.write(data)
    crc = Crc32c()
    crc.update(data)
    moved = tuple(dataclasses.replace(o, key=o.key.replace(ATTEMPT, attempt)) for o in objects)
    entry = ObjectEntry(key, len(data), crc.hexdigest())
    return RankReport(entry, moved, RequestStats(), digest)


def _noop() -> None:
    return None


def _one_save(
    helper: CommitHelper,
    plan: GlobalPlan,
    reports: list[RankReport],
    url_dir: str,
    label: str,
    attempt: str = ATTEMPT,
    upload: UploadOptions = EVERY,
) -> dict[str, Any]:
    world = len(reports)
    store = dist.HashStore()
    posted = []
    for r in range(world):
        ex = RankExchange(store, attempt, r, world, 60.0, url_dir)
        value = pickle.dumps((True, reports[r]))
        posted.append(len(f"objckpt/{attempt}/rank{r}") + len(value))
        if r:  # rank 0 posts its own inside the measured commit
            ex.post(True, reports[r])
    target = open_store(Location.parse(f"file://{url_dir}"), UploadOptions())
    writer = types.SimpleNamespace(
        global_plan=plan,
        rank_plan=types.SimpleNamespace(attempt=attempt, rank=0),
        deadline=None,
        target=types.SimpleNamespace(
            store=target,
            checkpoint_id=None,
            upload=upload,
            overwrite=False,
            reuse_from=None,
            user_metadata={},
            close=lambda: None,
        ),
    )
    pid = helper._pool.pids()[0] if helper._pool is not None else 0
    gc.collect()
    h0 = _cpu_of(pid)
    with Collections() as collections:
        t0, w0 = time.process_time(), time.perf_counter()
        exchange = RankExchange(store, attempt, 0, world, 60.0, url_dir)
        exchange.post(True, reports[0])
        gathered = exchange.gather()
        g0 = time.perf_counter()
        told: list[float] = []

        def committed(_: Any) -> None:  # as commit_phase does: the outcome, then step 4
            exchange.publish_outcome(None)
            told.append(time.perf_counter() - g0)

        manifest = helper.commit(writer, gathered, world, None, committed)  # type: ignore[arg-type]
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        finished = time.perf_counter() - g0
        published = told[0]
    helper_cpu = _cpu_of(pid) - h0
    stock = upload.writes_stock_metadata(world)
    assert len(manifest.objects) > world and os.path.exists(f"{url_dir}/.metadata") == stock
    return {
        "label": label,
        "rank0_cpu_s": cpu,
        "rank0_wall_s": wall,
        "rank0_gc": collections.summary(),
        "helper_cpu_s": helper_cpu,
        "published_after_gather_s": published,
        "metadata_written_after_gather_s": finished,
        "node_cpu_s": cpu + helper_cpu,
        "helper_peak_rss_bytes": _peak_rss_of(pid) if pid else 0,
        "metadata_bytes": os.path.getsize(f"{url_dir}/.metadata") if stock else 0,
        "manifest_bytes": os.path.getsize(f"{url_dir}/manifest.json"),
        "bytes": {"posted": posted},
    }


def dcp_global_plan(meta: Any) -> float:
    """CPU seconds of DCP's own ``DefaultSavePlanner.create_global_plan`` over the W
    local plans that give ``meta`` (what rank 0 runs in every first save of a plan,
    before any upload): the scale the new plan's layout is to be read against."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    tensors = {k: md for k, md in meta.state_dict_metadata.items() if hasattr(md, "chunks")}
    world = len(next(iter(tensors.values())).chunks)
    plans = []
    for rank in range(world):
        items = [
            WriteItem(
                index=MetadataIndex(fqn, md.chunks[rank].offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(md.chunks[rank].offsets, md.chunks[rank].sizes),
                    properties=md.properties,
                    size=md.size,
                ),
            )
            for fqn, md in tensors.items()
        ]
        plans.append(SavePlan(items, planner_data={fqn: (fqn,) for fqn in tensors}))
    gc.collect()
    t0 = time.process_time()
    DefaultSavePlanner().create_global_plan(plans)
    return time.process_time() - t0


def measure_commit(
    world: int,
    meta: Any,
    items: list[dict[MetadataIndex, StoredItem]],
    before: bool,
    dcp_plan: bool = False,
) -> dict[str, Any]:
    """Rank 0's commit at ``world`` ranks (``bench_scale.simulate``'s save), after #27
    item 2 and, with ``before``, the old way; with ``dcp_plan``, DCP's own global
    planning of the same save for scale."""
    after = measure_after(meta, items, keep=before)
    row: dict[str, Any] = {"world": world, "after": after}
    if dcp_plan:
        row["dcp_global_plan_cpu_s"] = dcp_global_plan(meta)
    gc.collect()
    if before:
        row["before"] = measure_before(meta, items)
    return row


def footprint(root: Any) -> dict[str, int]:
    """What keeping ``root`` costs: every object reachable from it once (shared ones
    once; types, modules and functions are not counted), their ``sys.getsizeof`` bytes,
    and how many of them the cyclic garbage collector tracks (each collection of the
    oldest generation walks them)."""
    import sys
    import types as pytypes

    skip = (type, pytypes.ModuleType, pytypes.FunctionType, pytypes.BuiltinFunctionType)
    seen: set[int] = set()
    stack = [root]
    objects = size = tracked = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        objects += 1
        size += sys.getsizeof(obj)
        if gc.is_tracked(obj):
            tracked += 1
            stack.extend(gc.get_referents(obj))
    return {"objects": objects, "bytes": size, "gc_tracked": tracked}


def plan_memory(worlds: str, simulate: Callable[[int], Any]) -> list[dict[str, Any]]:
    """What rank 0's plan cache keeps at each of ``worlds``, measured by
    :func:`footprint`: DCP's global ``Metadata`` of the plan (what it kept before #46,
    the row's top-level figures) and the :class:`~objckpt.format.commit.GlobalPlan`
    once its layout is built (``kept``: what it keeps now), with the layout's CPU."""
    rows = []
    for world in (int(w) for w in worlds.split(",") if w):
        meta, items = simulate(world)
        del items
        gc.collect()
        t0 = time.process_time()
        row = {"world": world, **footprint(meta), "measure_cpu_s": time.process_time() - t0}
        plan = GlobalPlan(meta)
        del meta
        t0 = time.process_time()
        plan.layout()
        row["layout_cpu_s"] = time.process_time() - t0
        assert not plan.holds_metadata, "the plan kept DCP's Metadata"
        gc.collect()
        row["kept"] = footprint(plan)
        del plan
        log.info("plan cache at W=%d: %s", world, json.dumps(row))
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--commit-worlds", default="", help="world sizes of rank 0's commit measurement"
    )
    parser.add_argument(
        "--commit-before-up-to", type=int, default=8192, help="largest W measured the old way"
    )
    parser.add_argument(
        "--plan-memory-worlds",
        default="",
        help="world sizes at which to measure what rank 0's plan cache keeps",
    )
    parser.add_argument(
        "--commit-dcp-plan-up-to",
        type=int,
        default=1024,
        help="largest W whose DCP create_global_plan is measured too",
    )


def run(
    worlds: str, before_up_to: int, simulate: Callable[[int], Any], dcp_plan_up_to: int = 0
) -> list[dict[str, Any]]:
    """``measure_commit`` at each of the comma-separated ``worlds``, logged as it goes."""
    rows = []
    for world in (int(w) for w in worlds.split(",") if w):
        log.info("commit at W=%d ...", world)
        meta, items = simulate(world)
        hint(items)
        rows.append(
            measure_commit(world, meta, items, world <= before_up_to, world <= dcp_plan_up_to)
        )
        del meta, items
        log.info("%s", json.dumps(rows[-1]))
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def commit_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| W | rank 0 process CPU per save, before | after: first save of a plan | after: "
        "later save | new plan's layout, during the uploads | commit helper CPU (later save) "
        "| helper peak RSS | c10d B per rank, before | after | DCP's create_global_plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["after"], r.get("before")
        first, later = a["saves"][:2]
        before = f"{b['rank0_cpu_s']:.2f} s" if b else "-"
        dcp = f"{r['dcp_global_plan_cpu_s']:.2f} s" if "dcp_global_plan_cpu_s" in r else "-"
        lines.append(
            f"| {r['world']} | {before} "
            f"| {first['rank0_cpu_s'] * 1e3:.0f} ms | {later['rank0_cpu_s'] * 1e3:.0f} ms "
            f"| {a.get('layout_cpu_s', 0) * 1e3:.0f} ms "
            f"| {later['helper_cpu_s']:.2f} s "
            f"| {later.get('helper_peak_rss_bytes', 0) / 2**30:.2f} GiB "
            f"| {_mb(b['c10d_bytes_per_rank_max']) if b else '-'} "
            f"| {a['c10d_bytes_per_rank_max']} B | {dcp} |"
        )
    return "\n".join(lines)


def publish_table(rows: list[dict[str, Any]]) -> str:
    """Per save: when the outcome is published after the gather, and the CPU rank 0's
    node spends on the commit (its process and the helper's); the last columns, a
    later save at the default ``stock_metadata_max_ranks``."""
    lines = [
        "| W | published after the gather: first / later save | `.metadata` written after "
        "the gather: first / later | rank 0's node CPU: first / later save | `.metadata` "
        "| helper peak RSS | default options: published / node CPU / `.metadata` |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first, later, default = r["after"]["saves"]
        lines.append(
            f"| {r['world']} "
            f"| {first.get('published_after_gather_s', 0):.2f} / "
            f"{later.get('published_after_gather_s', 0):.2f} s "
            f"| {first.get('metadata_written_after_gather_s', 0):.2f} / "
            f"{later.get('metadata_written_after_gather_s', 0):.2f} s "
            f"| {first.get('node_cpu_s', 0):.2f} / {later.get('node_cpu_s', 0):.2f} s "
            f"| {_mb(later['metadata_bytes'])} "
            f"| {later.get('helper_peak_rss_bytes', 0) / 2**30:.2f} GiB "
            f"| {default['published_after_gather_s']:.2f} s / {default['node_cpu_s']:.2f} s / "
            f"{_mb(default['metadata_bytes']) if default['metadata_bytes'] else 'none'} |"
        )
    return "\n".join(lines)
