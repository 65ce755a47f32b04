"""Per-rank cost on real processes: the same at 4 and at 16 gloo ranks.

The metadata benchmark (``bench/bench_scale.py``) simulates thousands of ranks in one
process; this test runs the real thing small. Each world size runs once, on W spawned
gloo processes against one moto server, and every rank reaches the store through a
recording :class:`~objckpt.testing.FaultProxy` of its own per path, so each request is
attributed to one rank and one path on the wire (no guessing from key names). The paths:
an async save through ``CheckpointManager`` (the default path), a sync ``dcp.save`` with
``ObjectStoreWriter``, a load through ``CheckpointManager.load``, and a plain
``dcp.load`` with ``ObjectStoreReader`` (default ``broadcast``, and ``broadcast=True``). The c10d
store's writes per path are read from the job's ``FileStore`` (see tests/support/scale_ranks.py).
The figures are logged at INFO as a Markdown table (``--log-cli-level=INFO``); the one
in docs/guides/at-scale.md comes from there.

What may grow with W is decided here, once:

* every rank but 0: nothing. Requests by operation are equal, bytes equal within
  :data:`SLACK` (rank numbers in keys and upload ids differ in length);
* rank 0, the coordinator, on a save: it writes the manifest and ``.metadata`` (both
  list every rank's objects: at most linear in W), lists the step's objects once before
  the commit (``require_present``: one request, at most linear bytes), and the index
  objects are one per rank, each written once (by whichever rank writes it: each rank
  its own since #27 item 2) and, on an async save, read back once by rank 0's commit
  helper to build ``.metadata`` off the training process (the first save of a plan,
  as here; a later one renames the last ``.metadata`` and reads none); the rest of its requests and
  bytes are flat;
* rank 0 on a load: it GETs the manifest (at most linear) and broadcasts it; the rest
  is flat;
* c10d, per save: at most a few small records per rank (each rank posts its own
  report: its index object's and payload objects' keys, sizes and CRC32Cs, and its
  request counts), none of them growing with W, and no key left behind.

Two things that once grew are held flat here: a plain ``ObjectStoreReader`` (default
``broadcast``) in a process group reads the manifest on rank 0 only, at ``dcp.load``'s
first step, and the manager's step catalog finds committed steps from one listing of
the root's step directories and a HEAD per step manifest (``format/steps.py``
``committed_steps``), never a listing of every rank's objects.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Mapping

import pytest
import scale_ranks
from ranks import run_ranks

from objckpt.testing import FaultProxy
from objckpt.testing.plugin import BUCKET
from objckpt.testing.rules import Seen
from objckpt.testing.servers import MotoServer

logger = logging.getLogger(__name__)

# One spawn of 16 ranks (plus one upload worker each) on two busy cores takes minutes.
pytestmark = pytest.mark.timeout(900)

WORLDS = (4, 16)
SAVES = ("manager_save", "dcp_save")
LOADS = ("manager_load", "dcp_load", "dcp_load_broadcast")
#: Bytes that may differ between ranks doing the same work: rank numbers in keys and
#: JSON ("__12_0" is one digit longer than "__2_0"), upload ids in responses.
SLACK = 64
_SHORT = {
    "PutObject": "PUT",
    "UploadPart": "UploadPart",
    "CreateMultipartUpload": "Create",
    "CompleteMultipartUpload": "Complete",
    "AbortMultipartUpload": "Abort",
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "HeadBucket": "HEAD",
    "ListObjectsV2": "LIST",
}
_INDEX = re.compile(r"__index_\d+\.")
_PAYLOAD = re.compile(r"__\d+_\d+\.")
_OWN_RESULTS = re.compile(r"/objckpt/[^/]+/rank(\d+)$")


def kind(path: str) -> str:
    """What a request's path names: manifest, metadata, index, payload or other."""
    name = path.rsplit("/", 1)[-1]
    if name == "manifest.json":
        return "manifest"
    if name == ".metadata":
        return "metadata"
    if _INDEX.match(name):
        return "index"
    return "payload" if _PAYLOAD.match(name) else "other"


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one rank sent and received through its proxy on one path."""

    seen: tuple[Seen, ...]
    received: Mapping[str, int]  # response bytes by operation

    def counts(self, *, skip: tuple[str, ...] = ()) -> dict[str, int]:
        """Requests by operation, leaving out those on objects of the kinds ``skip``."""
        return dict(collections.Counter(s.operation for s in self.seen if kind(s.path) not in skip))

    def sent(self, *, skip: tuple[str, ...] = ()) -> int:
        return sum(s.sent for s in self.seen if kind(s.path) not in skip)

    def sent_to(self, object_kind: str) -> int:
        return sum(s.sent for s in self.seen if kind(s.path) == object_kind)

    def paths(self, operation: str, object_kind: str) -> list[str]:
        return [
            s.path for s in self.seen if s.operation == operation and kind(s.path) == object_kind
        ]

    def got(self, *operations: str) -> int:
        return sum(self.received.get(op, 0) for op in operations)


@dataclasses.dataclass(frozen=True)
class C10d:
    """The c10d store writes of one path (every rank together), from the FileStore."""

    records: int  # set/add/delete records appended
    keys: int  # distinct keys set or added
    bytes: int  # key and value bytes appended
    left: int  # keys still in the store afterwards
    own: Mapping[int, int]  # rank -> bytes of the results it posted under its own key
    largest_shared: int  # the largest value written under a key of no single rank

    @classmethod
    def parse(cls, doc: dict) -> C10d:
        records = [(k, n) for k, n in doc["records"]]
        writes = [(k, n) for k, n in records if not k.startswith("-")]
        own: dict[int, int] = collections.defaultdict(int)
        shared = [0]
        for k, n in writes:
            m = _OWN_RESULTS.search(k)
            if m:
                own[int(m.group(1))] += n
            else:
                shared.append(n)
        return cls(
            records=len(records),
            keys=len({k for k, _ in writes}),
            bytes=sum(len(k) + n for k, n in records),
            left=doc["keys_left"],
            own=dict(own),
            largest_shared=max(shared),
        )


@dataclasses.dataclass(frozen=True)
class Run:
    """One world size: every rank's traffic per path, object sizes, c10d per path."""

    world: int
    traffic: Mapping[str, tuple[Traffic, ...]]
    sizes: Mapping[str, int]  # "/bucket/key" -> bytes on the store
    c10d: Mapping[str, C10d]

    def others(self, path: str) -> tuple[Traffic, ...]:
        return self.traffic[path][1:]

    def manifest_bytes_got(self, path: str, rank: int) -> int:
        """Response bytes of the manifest GETs ``rank`` made on ``path`` (whole objects)."""
        return sum(self.sizes[p] for p in self.traffic[path][rank].paths("GetObject", "manifest"))


def _run(moto: MotoServer, tmp_path_factory: pytest.TempPathFactory, world: int) -> Run:
    url = f"s3://{BUCKET}/scale-ranks/w{world}"
    work = tmp_path_factory.mktemp(f"w{world}")
    report = work / "c10d.json"
    with contextlib.ExitStack() as stack:
        proxies = [
            {p: stack.enter_context(FaultProxy(moto.endpoint_url)) for p in scale_ranks.PATHS}
            for _ in range(world)
        ]
        options = {
            "ranks": [{p: px.storage_options() for p, px in row.items()} for row in proxies],
            "report": str(report),
        }
        args = ("measure", world, str(work / "init"), url, options)
        run_ranks(scale_ranks, *args)
        traffic = {
            p: tuple(
                Traffic(tuple(row[p].seen), {op: row[p].received_bytes(op) for op in _SHORT})
                for row in proxies
            )
            for p in scale_ranks.PATHS
        }
    pages = moto.boto3_client().get_paginator("list_objects_v2")
    sizes = {
        f"/{BUCKET}/{o['Key']}": o["Size"]
        for page in pages.paginate(Bucket=BUCKET, Prefix=f"scale-ranks/w{world}/")
        for o in page.get("Contents", ())
    }
    c10d = {p: C10d.parse(d) for p, d in json.loads(report.read_text()).items()}
    return Run(world, traffic, sizes, c10d)


def _ops(counts: Mapping[str, int]) -> str:
    merged: dict[str, int] = collections.Counter()
    for op, n in counts.items():
        merged[_SHORT.get(op, op)] += n
    return ", ".join(f"{op} {n}" for op, n in sorted(merged.items()))


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def table(runs: Mapping[int, Run]) -> str:
    """The measured figures as a Markdown table (docs/guides/at-scale.md)."""
    lines = [
        "| path | W | rank 0: requests | sent / received B | other ranks: requests (most) "
        "| sent / received B | c10d per save: records / keys / B (B per rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in scale_ranks.PATHS:
        for w, run in runs.items():
            zero = run.traffic[path][0]
            others = run.others(path)
            most = {op: max(t.counts().get(op, 0) for t in others) for op in _SHORT}
            c = run.c10d[path]
            lines.append(
                f"| {path} | {w} | {_ops(zero.counts())} | {zero.sent():,} / "
                f"{zero.got(*_SHORT):,} | {_ops({k: v for k, v in most.items() if v})} | "
                f"{_span([t.sent() for t in others])} / "
                f"{_span([t.got(*_SHORT) for t in others])} | "
                f"{c.records} / {c.keys} / {c.bytes:,} ({c.bytes / w:,.0f}) |"
            )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def runs(
    moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[int, Run]]:
    moto_server.reset()
    moto_server.boto3_client().create_bucket(Bucket=BUCKET)
    out = {w: _run(moto_server, tmp_path_factory, w) for w in WORLDS}
    logger.info("per-rank cost at W = %s:\n%s", WORLDS, table(out))
    yield out


def _bytes_within(got: int, low: int, high: int, what: str) -> None:
    assert low - SLACK <= got <= high + SLACK, f"{what}: {got} B, {low}..{high} B at W=4"


def _flat(
    small: list[int], large: list[int], what: str, *, exact: bool, name: str = "rank"
) -> None:
    """Every value at W=16 (rank 1, 2, ... or the ``name``d things in order) lies within
    the range of the values at W=4 (± SLACK for bytes)."""
    low, high = min(small), max(small)
    for r, got in enumerate(large, start=1):
        if exact:
            assert low <= got <= high, f"{name} {r} at W=16: {what} {got}, {low}..{high} at W=4"
        else:
            _bytes_within(got, low, high, f"{name} {r} at W=16: {what}")


@pytest.mark.parametrize("path", scale_ranks.PATHS)
def test_every_rank_but_the_coordinator_costs_the_same(runs: dict[int, Run], path: str) -> None:
    small, large = runs[4], runs[16]
    ops = {op for run in (small, large) for t in run.others(path) for op in t.counts()}
    for op in sorted(ops):
        _flat(
            [t.counts().get(op, 0) for t in small.others(path)],
            [t.counts().get(op, 0) for t in large.others(path)],
            f"{op} requests on {path}",
            exact=True,
        )
    _flat(
        [t.sent() for t in small.others(path)],
        [t.sent() for t in large.others(path)],
        f"bytes sent on {path}",
        exact=False,
    )
    # Rank 0 reads the manifest for everyone, on every path.
    for run in (small, large):
        for r in range(1, run.world):
            got = len(run.traffic[path][r].paths("GetObject", "manifest"))
            assert got == 0, f"rank {r} of {run.world} GETs the manifest {got} times on {path}"
    _flat(
        [
            t.got(*_SHORT) - small.manifest_bytes_got(path, r)
            for r, t in enumerate(small.others(path), 1)
        ],
        [
            t.got(*_SHORT) - large.manifest_bytes_got(path, r)
            for r, t in enumerate(large.others(path), 1)
        ],
        f"bytes received on {path} (a plain reader's manifest aside)",
        exact=False,
    )


def test_a_plain_reader_reads_the_manifest_once_per_job(runs: dict[int, Run]) -> None:
    _flat(
        [t.got("GetObject") for t in runs[4].others("dcp_load")],
        [t.got("GetObject") for t in runs[16].others("dcp_load")],
        "bytes received on dcp_load (manifest included)",
        exact=False,
    )


@pytest.mark.parametrize("path", scale_ranks.PATHS)
def test_the_coordinator_grows_only_by_what_names_every_rank(
    runs: dict[int, Run], path: str
) -> None:
    small, large = runs[4], runs[16]
    # Index objects: one per rank, each written once, whichever rank writes it.
    for run in (small, large):
        written = [p for t in run.traffic[path] for p in t.paths("PutObject", "index")]
        if path in SAVES:
            assert len(written) == len(set(written)) == run.world, written
        else:
            assert written == []
    zero4, zero16 = small.traffic[path][0], large.traffic[path][0]
    flat = ("index",)  # rank 0's requests but the index objects it writes
    c4, c16 = zero4.counts(skip=flat), zero16.counts(skip=flat)
    assert c16 == c4, f"rank 0's requests on {path} (index PUTs aside): {c16} at 16, {c4} at 4"
    if path in SAVES:
        _flat(
            _index_sizes(small, path), _index_sizes(large, path), "bytes", exact=False, name="index"
        )
    # What names every rank: manifest and .metadata PUT bodies, the manifest GET.
    grows = ("index", "manifest", "metadata")
    _bytes_within(
        zero16.sent(skip=grows), zero4.sent(skip=grows), zero4.sent(skip=grows), "rank 0 sent"
    )
    for what in ("manifest", "metadata"):
        assert zero16.sent_to(what) <= 4 * zero4.sent_to(what) + SLACK, f"{what} more than linear"
    # An async save's commit helper (rank 0) reads every rank's index object once, to
    # build .metadata off the training process: linear, like the .metadata it builds.
    for run in (small, large):
        read = run.traffic[path][0].paths("GetObject", "index") if path in SAVES else []
        if path == "manager_save":
            assert len(read) == len(set(read)) == run.world, read
        else:
            assert read == [], read
    got4 = zero4.got("GetObject") - small.manifest_bytes_got(path, 0) - _index_got(small, path)
    got16 = zero16.got("GetObject") - large.manifest_bytes_got(path, 0) - _index_got(large, path)
    _bytes_within(got16, got4, got4, "rank 0's GET bytes but the manifest and index read-back")
    m4, m16 = small.manifest_bytes_got(path, 0), large.manifest_bytes_got(path, 0)
    assert m16 <= 4 * m4 + SLACK, f"rank 0 fetched {m16} B of manifest at W=16, {m4} B at W=4"


def _index_got(run: Run, path: str) -> int:
    """Bytes of the index objects rank 0 GETs on a save (its commit helper's read-back)."""
    if path not in SAVES:
        return 0
    return sum(run.sizes[p] for p in run.traffic[path][0].paths("GetObject", "index"))


def _index_sizes(run: Run, path: str) -> list[int]:
    return [run.sizes[p] for t in run.traffic[path] for p in t.paths("PutObject", "index")]


@pytest.mark.parametrize("path", SAVES)
def test_the_coordinator_lists_the_step_it_commits_once(runs: dict[int, Run], path: str) -> None:
    """Rank 0's LISTs on a save are as many at 16 ranks as at 4; their bytes grow at most
    linearly: before the commit it lists the step's objects once (``require_present``:
    every rank's payload and index, O(W) in one request), which is the coordinator's."""
    zero4, zero16 = runs[4].traffic[path][0], runs[16].traffic[path][0]
    _same_lists(zero4, zero16, path)
    got4, got16 = zero4.got("ListObjectsV2"), zero16.got("ListObjectsV2")
    assert got16 <= 4 * got4 + SLACK, f"rank 0 LIST bytes on {path}: {got16} at 16, {got4} at 4"


def test_the_manager_finds_its_steps_without_listing_every_rank_s_objects(
    runs: dict[int, Run],
) -> None:
    zero4, zero16 = runs[4].traffic["manager_load"][0], runs[16].traffic["manager_load"][0]
    _same_lists(zero4, zero16, "manager_load")
    _bytes_within(
        zero16.got("ListObjectsV2"),
        zero4.got("ListObjectsV2"),
        zero4.got("ListObjectsV2"),
        "rank 0's LIST bytes on manager_load",
    )


def _same_lists(zero4: Traffic, zero16: Traffic, path: str) -> None:
    n4, n16 = zero4.counts().get("ListObjectsV2", 0), zero16.counts().get("ListObjectsV2", 0)
    assert n16 == n4, f"rank 0 LISTs {n16} times on {path} at W=16, {n4} at W=4"


def test_c10d_per_save_is_small_and_flat_per_rank(runs: dict[int, Run]) -> None:
    small, large = runs[4].c10d, runs[16].c10d
    for path in scale_ranks.PATHS:
        assert small[path].left == large[path].left == 0, f"{path} left c10d keys behind"
    for path in ("dcp_save", *LOADS):  # DCP's own collectives (gloo) carry these
        assert small[path].records == large[path].records == 0, path
    s, big = small["manager_save"], large["manager_save"]
    assert sorted(s.own) == list(range(4)) and sorted(big.own) == list(range(16)), (s, big)
    _flat(list(s.own.values()), list(big.own.values()), "bytes of own results", exact=False)
    _bytes_within(big.largest_shared, s.largest_shared, s.largest_shared, "a shared c10d value")
    for what in ("records", "keys", "bytes"):
        per4, per16 = getattr(s, what) / 4, getattr(big, what) / 16
        assert per16 <= per4 * 1.02, (
            f"c10d {what} per rank per save: {per16:g} at 16, {per4:g} at 4"
        )
