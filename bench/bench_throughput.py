"""Save/load wall time and client CPU per GiB: objckpt beside AWS s3torchconnector and DCP.

Every method runs against the same moto server process, with the same synthetic
transformer-shaped state dict, warm (one untimed run first, clients reused where the
method allows it), and reports the median of ``--repeats`` runs:

* ``s3tc``: AWS s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (CRT
  client, ``thread_count`` as given; its endpoint pointed at moto, path style);
  skipped with a message when the ``bench`` extra is not installed;
* ``objckpt``: ``ObjectStoreWriter``/``ObjectStoreReader``, one writer and one reader
  reused through ``checkpoint_id`` (their clients stay warm, as s3torchconnector's does);
  ``objckpt_load_whole_objects`` loads again with ranges as large as objects (a moto
  diagnostic: moto copies the whole object for every ranged GET);
  ``*_load_in_place`` (objckpt and s3tc) load into tensors that exist and were written
  before the timed runs (a model restored in place), where ``*_load`` allocates new
  ones per run, whose first touch the load then pays (:func:`in_place_target`);
* ``boto3``: boto3's managed multipart upload of the same bytes (not a ceiling);
* ``fsspec``: torch's ``FsspecWriter``/``FsspecReader``;
* ``objckpt_async``: one ``AsyncCheckpointer`` reused; stall = ``save()`` returning,
  commit = ``result()``;
* ``dcp_async``: ``dcp.async_save`` (thread executor) with ``FsspecWriter``;
* ``floor``: what the load's contract costs at least with the two Python HTTP clients at
  hand, no objckpt code: the state's bytes in objects of 64 MiB (objckpt's default
  ``object_size``), read in 16 MiB ranged GETs
  (all in flight at once) into memory that exists, then a CRC32C pass over every byte.
  ``floor_load_aiohttp`` receives through aiobotocore and aiohttp, objckpt's transport
  (each chunk copied into place); ``floor_load_readinto`` through botocore and
  ``http.client``, whose ``readinto`` receives straight into the destination, one
  thread per GET (the limit of a receive into the tensor, #47). The save's floor:
  the same bytes uploaded in objckpt's default layout (objects of 64 MiB in 16 MiB
  parts, 8 in flight, a Create and a Complete per object) with each part's CRC32C sent
  for the store to check, ``floor_save_aiohttp`` through aiobotocore and aiohttp (the
  body in 1 MiB views, as objckpt sends it) and ``floor_save_sendall`` through botocore
  and ``http.client`` (each part one ``sendall`` of a view, a thread per part);
* ``copy_limit``: a plain copy of the state into preallocated memory
  (``bench_async.copy_limit``), the floor for the default async stall;
* ``objckpt_async_bg`` / ``dcp_async_bg``: the same with the copy in the background
  (``AsyncOptions(background_staging=True)`` / DCP's ``DefaultStager`` with
  ``use_async_staging``): stall = the call returning, ``staged_s`` = the copy done.

**Cold and warm side by side** for the sync save of objckpt and s3torchconnector: the
warm rows above reuse a writer or client in this process after an untimed run; the
cold rows (``--cold-runs``, default 5, median) run each save in a FRESH process
(``bench/cold_save.py``: the library's import, its writer and client, and the save;
torch's import and the state's load are outside the span), alternating the methods.
``objckpt_save_new_writer`` is a new ``ObjectStoreWriter`` per save in this (warm)
process: what a job that builds a writer per save pays. ``--fresh-clients`` builds a
new client for every writer and reader, as objckpt did before its per-process client
cache (#27 item 4), for before/after figures in one tree.

Client CPU is user+sys of this process (all its threads) plus, for objckpt's async
saves, its upload workers (read from /proc), never the server's; for a cold run,
user+sys of that process and its children. Peak tree RSS and
PSS are sampled every 20 ms over this process and its children, the server excluded
(RSS counts a shared staging segment once per process mapping it; PSS splits it).

``--server rgw`` runs the same against Ceph RGW (Debian's radosgw, started in a temporary
cluster by :mod:`objckpt.testing.rgw`), a real S3 implementation: no reset API, so each
run gets a new bucket; ranged GETs cost what they read, unlike moto's.

Usage: ``python bench/bench_throughput.py [--size-mib 256] [--repeats 3] [--cold-runs 5]
[--only cold,sync,s3tc,boto3,fsspec,async,dcp_async,floor] [--fresh-clients] [--server rgw]
[--equal-tensors 16]``
Results go to ``bench/results/throughput-<date>-<size>mib.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import smoke
import torch
import torch.distributed.checkpoint as dcp
from bench_async import copy_limit
from bench_sync import nbytes, transformer_state, zeros_like
from cold import cold_rows, fresh_bucket, no_client_cache, run_cold
from proc_stats import TreeRss, measure
from record import write_record
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

import objckpt
from objckpt.testing.servers import offline_env, start_moto_server

log = logging.getLogger("bench")
MiB = 1024 * 1024
GROUPS = ("cold", "sync", "s3tc", "boto3", "fsspec", "async", "dcp_async", "floor")
#: Ranged GETs of the transport-floor rows: ReadOptions.range_size's default.
FLOOR_RANGE = 16 * MiB
#: GETs in flight in the transport-floor rows: a 256 MiB state's 16 ranges at once, as
#: objckpt's reader runs them (its ReadOptions.max_in_flight_bytes is 512 MiB).
FLOOR_IN_FLIGHT = 16


def run(
    size_mib: int,
    repeats: int,
    s3tc_threads: int,
    cold_runs: int = 5,
    only: tuple[str, ...] = GROUPS,
    fresh_clients: bool = False,
    kind: str = "moto",
    equal_tensors: int = 0,
) -> dict[str, Any]:
    os.environ.update(offline_env())
    torch.set_num_threads(1)
    if fresh_clients:
        no_client_cache()
    with contextlib.ExitStack() as stack:
        server: Any
        if kind == "rgw":
            # A real S3 implementation (Debian's radosgw), in a cluster of its own.
            from objckpt.testing.rgw import start_rgw

            server = start_rgw(stack.enter_context(tempfile.TemporaryDirectory()))
        else:
            server = start_moto_server()
        stack.callback(server.stop)
        state = (
            equal_state(size_mib, equal_tensors) if equal_tensors else transformer_state(size_mib)
        )
        gib = nbytes(state) / 2**30
        out = _run_all(server, state, gib, repeats, s3tc_threads, only)
        out["server"] = kind
        if "cold" in only:
            out["cold"] = run_cold(server, state, cold_runs, s3tc_threads)
        return out


def equal_state(size_mib: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of equal size: the per-byte cost with little per-tensor
    work (16 of 16 MiB is the shape #47's independent measurement used)."""
    numel = size_mib * MiB // 4 // tensors
    return {f"t{i}": torch.randn(numel) for i in range(tensors)}


def in_place_target(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A destination that already exists and has been written, as a model's parameters
    have when a job restores into them: loads into it pay no first touch of fresh
    pages. A load into new tensors (the ``*_load`` rows) also pays the kernel's page
    faults and zeroing of the destination, which glibc maps afresh for every tensor
    of 32 MiB or more, so those rows count memory the loader did not choose."""
    target = zeros_like(state)
    for t in target.values():
        t.zero_()
    return target


def _run_all(
    server: Any,
    state: dict[str, torch.Tensor],
    gib: float,
    repeats: int,
    threads: int,
    only: tuple[str, ...] = GROUPS,
) -> dict[str, Any]:
    client = server.boto3_client()
    opts = server.storage_options()
    os.environ["AWS_ACCESS_KEY_ID"] = opts["key"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = opts["secret"]
    none: Callable[[], list[int]] = list
    counter = [0]
    out: dict[str, Any] = {"gib": gib}

    bucket = ["bench"]

    def fresh() -> None:
        counter[0] += 1
        bucket[0] = fresh_bucket(server, client, counter[0])

    def url(name: str) -> str:
        return f"s3://{bucket[0]}/{name}{counter[0]}"

    def check(load_fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
        got = zeros_like(state)
        load_fn(got)
        assert all(torch.equal(got[k], v) for k, v in state.items()), "wrong data loaded"

    fs_kwargs = {
        "endpoint_url": opts["endpoint_url"],
        "key": opts["key"],
        "secret": opts["secret"],
    }

    if "boto3" in only:
        # -- boto3 ------------------------------------------------------------------------------
        from boto3.s3.transfer import TransferConfig

        blob = [b"".join(t.numpy().tobytes() for t in state.values())]

        def boto3_upload() -> None:
            client.upload_fileobj(io.BytesIO(blob[0]), bucket[0], "blob", Config=TransferConfig())

        out["boto3_save"] = measure(boto3_upload, fresh, repeats, none)
        blob.clear()

    if "sync" in only:
        # -- objckpt sync -------------------------------------------------------------------------
        writer = objckpt.ObjectStoreWriter(url("warm"), storage_options=opts)

        def objckpt_save() -> None:
            dcp.save(state, storage_writer=writer, checkpoint_id=url("o"))

        out["objckpt_save"] = measure(objckpt_save, fresh, repeats, none)

        reader = objckpt.ObjectStoreReader(url("o"), storage_options=opts)

        def objckpt_load(target: dict[str, torch.Tensor] | None = None) -> None:
            got = zeros_like(state) if target is None else target
            dcp.load(got, storage_reader=reader, checkpoint_id=url("o"))

        out["objckpt_load"] = measure(objckpt_load, lambda: None, repeats, none)
        check(objckpt_load)
        model = in_place_target(state)
        out["objckpt_load_in_place"] = measure(
            lambda: objckpt_load(model), lambda: None, repeats, none
        )
        assert all(torch.equal(model[k], v) for k, v in state.items()), "wrong data loaded"
        del model  # the rows after it allocate as before it was added

        # A diagnostic, not a setting to copy: moto answers every ranged GET by copying the
        # whole object first, so on moto a load costs (GETs per object x object size). With
        # ranges as large as objects each object is one GET; on S3, where a ranged GET
        # costs its range, the default 16 MiB ranges give a small state more parallel GETs.
        whole = objckpt.ObjectStoreReader(
            url("o"),
            storage_options=opts,
            read=objckpt.ReadOptions(range_size=objckpt.UploadOptions().object_size),
        )

        def objckpt_load_whole(target: dict[str, torch.Tensor] | None = None) -> None:
            got = zeros_like(state) if target is None else target
            dcp.load(got, storage_reader=whole, checkpoint_id=url("o"))

        out["objckpt_load_whole_objects"] = measure(objckpt_load_whole, lambda: None, repeats, none)
        check(objckpt_load_whole)

        # After the loads: each run's server reset drops the checkpoint they read.
        def objckpt_save_new_writer() -> None:
            new = objckpt.ObjectStoreWriter(url("n"), storage_options=opts)
            dcp.save(state, storage_writer=new)

        out["objckpt_save_new_writer"] = measure(objckpt_save_new_writer, fresh, repeats, none)

    if "s3tc" in only:
        # -- s3torchconnector -------------------------------------------------------------------
        try:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
            from s3torchconnector.dcp.s3_file_system import S3FileSystem
        except ImportError:
            log.warning("s3torchconnector is not installed (pip install '.[bench]'): skipped")
        else:
            config = S3ClientConfig(force_path_style=True)
            s3 = S3Client("us-east-1", endpoint=opts["endpoint_url"], s3client_config=config)

            def s3tc_writer(path: str) -> Any:
                w = S3StorageWriter("us-east-1", path, s3client_config=config, thread_count=threads)
                w.fs = S3FileSystem("us-east-1", s3_client=s3)
                w.path = w.fs.init_path(path)
                return w

            def s3tc_save() -> None:
                dcp.save(state, storage_writer=s3tc_writer(url("s")))

            def s3tc_load(target: dict[str, torch.Tensor] | None = None) -> None:
                reader = S3StorageReader("us-east-1", url("s"), s3client_config=config)
                reader.fs = S3FileSystem("us-east-1", s3_client=s3)
                reader.path = reader.fs.init_path(url("s"))
                dcp.load(zeros_like(state) if target is None else target, storage_reader=reader)

            try:
                out["s3tc_save"] = measure(s3tc_save, fresh, repeats, none)
                out["s3tc_load"] = measure(s3tc_load, lambda: None, repeats, none)
                check(s3tc_load)
                model = in_place_target(state)
                out["s3tc_load_in_place"] = measure(
                    lambda: s3tc_load(model), lambda: None, repeats, none
                )
                assert all(torch.equal(model[k], v) for k, v in state.items()), "wrong data"
                del model
            except (Exception, CheckpointException) as exc:
                # A peer that cannot run against this server is a finding, not a crash
                # of the whole comparison (s3torchconnector 1.5 on Ceph RGW 16.2: RGW
                # answers CompleteMultipartUpload with an empty ETag, which the CRT
                # client refuses).
                out.pop("s3tc_save", None)
                out["s3tc_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.warning("s3torchconnector failed on this server: %s", out["s3tc_error"])
            out["s3tc_thread_count"] = threads

    if "floor" in only:
        # -- the transport's floor for a load (no objckpt code) ---------------------------------
        fresh()
        out.update(transport_floor(server, bucket[0], state, repeats))

    if "fsspec" in only:
        # -- fsspec ---------------------------------------------------------------------------

        def fsspec_save() -> None:
            dcp.save(state, storage_writer=FsspecWriter(url("f"), sync_files=False, **fs_kwargs))

        def fsspec_load() -> None:
            dcp.load(zeros_like(state), storage_reader=FsspecReader(url("f"), **fs_kwargs))

        out["fsspec_save"] = measure(fsspec_save, fresh, repeats, none)
        out["fsspec_load"] = measure(fsspec_load, lambda: None, repeats, none)

    if "async" in only:
        # -- async ------------------------------------------------------------------------------
        # Memory over a baseline taken before the checkpointer exists (this process, holding
        # the state dict): the workers, the staging copy and the parts in flight all count.
        base = TreeRss(exclude=server.process.pid).pss_now()
        with objckpt.AsyncCheckpointer(storage_options=opts) as ckpt:
            stalls: list[float] = []

            def objckpt_async() -> None:
                t0 = time.perf_counter()
                handle = ckpt.save(state, url("a"))
                stalls.append(time.perf_counter() - t0)
                handle.result(timeout=600)

            out["objckpt_async"] = measure(objckpt_async, fresh, repeats, lambda: ckpt.worker_pids)
            out["objckpt_async"]["stall_s"] = statistics.median(stalls[1 : repeats + 1])
            out["copy_limit_s"] = statistics.median(copy_limit(state, max(repeats, 5)))
            # Memory in a run of its own: reading /proc while timing would add CPU.
            fresh()
            with TreeRss(exclude=server.process.pid) as rss:
                objckpt_async()
            out["objckpt_async"]["peak_tree_rss"] = rss.peak
            out["objckpt_async"]["peak_tree_pss"] = rss.peak_pss
            out["objckpt_async"]["pss_over_baseline"] = rss.peak_pss - base

        # Background staging: save() returns before the copy; a training loop would run
        # forward/backward and call wait_staged() before optimizer.step(). staged_s is
        # the time from save() to wait_staged() returning with nothing overlapped.
        bg = objckpt.AsyncOptions(background_staging=True)
        with objckpt.AsyncCheckpointer(storage_options=opts, async_options=bg) as ckpt:
            bg_stalls: list[float] = []
            bg_staged: list[float] = []

            def objckpt_async_bg() -> None:
                t0 = time.perf_counter()
                handle = ckpt.save(state, url("b"))
                bg_stalls.append(time.perf_counter() - t0)
                handle.wait_staged()
                bg_staged.append(time.perf_counter() - t0)
                handle.result(timeout=600)

            out["objckpt_async_bg"] = measure(
                objckpt_async_bg, fresh, repeats, lambda: ckpt.worker_pids
            )
            out["objckpt_async_bg"]["stall_s"] = statistics.median(bg_stalls[1 : repeats + 1])
            out["objckpt_async_bg"]["staged_s"] = statistics.median(bg_staged[1 : repeats + 1])

    if "dcp_async" in only:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        dcp_stalls: list[float] = []

        def dcp_async() -> None:
            t0 = time.perf_counter()
            fut = dcp.async_save(
                state,
                storage_writer=FsspecWriter(url("d"), sync_files=False, **fs_kwargs),
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
            dcp_stalls.append(time.perf_counter() - t0)
            fut.result()

        base = TreeRss(exclude=server.process.pid).pss_now()
        out["dcp_async"] = measure(dcp_async, fresh, repeats, none)
        out["dcp_async"]["stall_s"] = statistics.median(dcp_stalls[1 : repeats + 1])
        fresh()
        with TreeRss(exclude=server.process.pid) as rss:
            dcp_async()
        out["dcp_async"]["peak_tree_rss"] = rss.peak
        out["dcp_async"]["peak_tree_pss"] = rss.peak_pss
        out["dcp_async"]["pss_over_baseline"] = rss.peak_pss - base

        # dcp.async_save's own background staging (DefaultStager, use_async_staging): the
        # like-for-like peer of objckpt's background_staging. Pinned memory and
        # non-blocking copies need CUDA.
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_non_blocking_copy=cuda, use_async_staging=True
            )
        )
        dbg_stalls: list[float] = []
        dbg_staged: list[float] = []

        def dcp_async_bg() -> None:
            t0 = time.perf_counter()
            response = dcp.async_save(
                state,
                storage_writer=FsspecWriter(url("e"), sync_files=False, **fs_kwargs),
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                async_stager=stager,
            )
            dbg_stalls.append(time.perf_counter() - t0)
            response.staging_completion.result()
            dbg_staged.append(time.perf_counter() - t0)
            response.upload_completion.result()

        out["dcp_async_bg"] = measure(dcp_async_bg, fresh, repeats, none)
        out["dcp_async_bg"]["stall_s"] = statistics.median(dbg_stalls[1 : repeats + 1])
        out["dcp_async_bg"]["staged_s"] = statistics.median(dbg_staged[1 : repeats + 1])
        stager.close()
    return out


def transport_floor(
    server: Any, bucket: str, state: dict[str, torch.Tensor], repeats: int
) -> dict[str, Any]:
    """The ``floor`` rows: the state's bytes, stored as objects of objckpt's default
    ``object_size``, read back as :data:`FLOOR_RANGE` GETs into
    a buffer that exists, each range then CRC32C'd (objckpt checks every byte), by
    aiobotocore/aiohttp (objckpt's transport) and by botocore/``http.client``
    ``readinto`` (a receive straight into the destination). Both checked bit-exact."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import aiobotocore.session
    import botocore.session
    import crc32c
    from botocore.config import Config

    blob = b"".join(t.numpy().tobytes() for t in state.values())
    opts = server.storage_options()
    # Objects of objckpt's default object_size, as its payload objects are (moto copies a
    # whole object per ranged GET, so one large object would slow its answers down).
    size = objckpt.UploadOptions().object_size
    client = server.boto3_client()
    for at in range(0, len(blob), size):
        client.put_object(Bucket=bucket, Key=f"floor{at // size}", Body=blob[at : at + size])
    # (key, start in the object, start in the state, end in the state)
    ranges = [
        (
            f"floor{at // size}",
            at % size,
            at,
            min(at + FLOOR_RANGE, (at // size + 1) * size, len(blob)),
        )
        for at in range(0, len(blob), FLOOR_RANGE)
    ]
    dest = bytearray(len(blob))  # written below before any timed run: in place
    view = memoryview(dest)
    # As objckpt configures its client: no SDK checksum (objckpt sends its own CRC32C
    # where a request carries a payload), no payload SHA256, one attempt.
    config = Config(
        max_pool_connections=FLOOR_IN_FLIGHT,
        retries={"total_max_attempts": 1},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False},
    )
    client_args = {
        "endpoint_url": opts["endpoint_url"],
        "aws_access_key_id": opts["key"],
        "aws_secret_access_key": opts["secret"],
        "region_name": "us-east-1",
        "config": config,
    }

    def check_all() -> None:
        for _, _, start, end in ranges:
            crc32c.crc32c(view[start:end])

    sync = botocore.session.get_session().create_client("s3", **client_args)
    pool = ThreadPoolExecutor(FLOOR_IN_FLIGHT)

    def get_into(span: tuple[str, int, int, int]) -> None:
        key, first, start, end = span
        asked = f"bytes={first}-{first + end - start - 1}"
        body = sync.get_object(Bucket=bucket, Key=key, Range=asked)["Body"]
        # urllib3's own readinto reads into a bytes object and copies; http.client's (its
        # _fp) receives into the buffer given, as objckpt.writers.s3_direct does.
        raw = body._raw_stream
        got = start
        while got < end:
            n = raw._fp.readinto(view[got:end])
            if not n:
                raise EOFError(f"floor: range {start}-{end} cut at {got}")
            got += n
        raw.release_conn()

    def readinto_load() -> None:
        list(pool.map(get_into, ranges))
        check_all()

    loop = asyncio.new_event_loop()
    made = aiobotocore.session.get_session().create_client("s3", **client_args)
    aio = loop.run_until_complete(made.__aenter__())

    async def get_chunks(key: str, first: int, start: int, end: int) -> None:
        asked = f"bytes={first}-{first + end - start - 1}"
        resp = await aio.get_object(Bucket=bucket, Key=key, Range=asked)
        body, at = resp["Body"], start
        stream = body.raw_stream  # the aiohttp response, as objckpt reads it
        while chunk := await stream.content.readany():
            view[at : at + len(chunk)] = chunk
            at += len(chunk)
        body.close()
        if at != end:
            raise EOFError(f"floor: range {start}-{end} cut at {at}")

    async def all_chunks() -> None:
        await asyncio.gather(*(get_chunks(*span) for span in ranges))

    def aiohttp_load() -> None:
        loop.run_until_complete(all_chunks())
        check_all()

    rows: dict[str, Any] = {}
    try:
        for name, load in (
            ("floor_load_aiohttp", aiohttp_load),
            ("floor_load_readinto", readinto_load),
        ):
            view[:] = bytes(len(dest))
            rows[name] = measure(load, lambda: None, repeats, list)
            if dest != blob:
                raise RuntimeError(f"{name}: wrong data loaded")
        rows.update(save_floor(bucket, memoryview(blob), client, sync, aio, loop, repeats))
    finally:
        loop.run_until_complete(made.__aexit__(None, None, None))
        loop.close()
        pool.shutdown()
        sync.close()
    return rows


def save_floor(
    bucket: str, blob: memoryview, check: Any, sync: Any, aio: Any, loop: Any, repeats: int
) -> dict[str, Any]:
    """The save's ``floor`` rows: the state's bytes uploaded as objckpt's default
    layout uploads them (objects of ``object_size`` in parts of ``part_size``, a
    Create, the parts and a Complete per object, ``max_parts_in_flight`` parts in
    flight), each part's CRC32C computed and sent for the store to check (objckpt's
    contract), configured as objckpt configures its client (no SDK checksum, no
    payload SHA256). ``floor_save_aiohttp`` sends through aiobotocore and aiohttp,
    the body in 1 MiB views as objckpt sends it (:class:`StreamedBody`);
    ``floor_save_sendall`` through botocore and ``http.client``, one thread per part
    in flight, each part handed to the socket whole (one ``sendall`` of a view of the
    state, no copy). Every object is read back and compared after the timed runs."""
    import asyncio
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import crc32c

    from objckpt.writers.body import StreamedBody

    defaults = objckpt.UploadOptions()
    part, size, in_flight = defaults.part_size, defaults.object_size, defaults.max_parts_in_flight
    objects = [(at, min(at + size, blob.nbytes)) for at in range(0, blob.nbytes, size)]
    runs = iter(range(1_000_000))
    keys: list[str] = []

    def parts(start: int, end: int) -> list[tuple[int, memoryview]]:
        starts = range(start, end, part)
        return [(n + 1, blob[at : min(at + part, end)]) for n, at in enumerate(starts)]

    def part_request(
        key: str, upload: str, number: int, data: memoryview, body: type[StreamedBody]
    ) -> dict[str, Any]:
        """UploadPart's arguments: the part as a ``body``, its length and its CRC32C
        (computed here, in the timed span)."""
        crc = crc32c.crc32c(data)
        return {
            "Bucket": bucket,
            "Key": key,
            "UploadId": upload,
            "PartNumber": number,
            "Body": body(data),
            "ContentLength": data.nbytes,
            "ChecksumCRC32C": base64.b64encode(crc.to_bytes(4, "big")).decode(),
        }

    def part_done(asked: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        """The part as CompleteMultipartUpload names it."""
        return {
            "PartNumber": asked["PartNumber"],
            "ETag": answer["ETag"],
            "ChecksumCRC32C": asked["ChecksumCRC32C"],
        }

    class WholeBody(StreamedBody):
        """A part botocore accepts (file-like: it refuses a memoryview) whose view
        ``sendall_whole`` hands to ``http.client``, which sends a buffer with one
        ``sendall`` where it would copy a file-like body out in 16 KiB reads."""

        def __init__(self, data: memoryview) -> None:
            super().__init__(data)
            self.whole = data

    def sendall_whole(request: Any, **_: Any) -> None:
        if isinstance(request.body, WholeBody):
            request.body = request.body.whole

    sync.meta.events.register("before-send.s3.UploadPart", sendall_whole)
    pool = ThreadPoolExecutor(in_flight)

    def sendall_save() -> None:
        run = next(runs)
        started = []
        for n, (start, end) in enumerate(objects):
            key = f"floor-save/{run}/{n}"
            keys.append(key)
            made = sync.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")
            started.append((key, made["UploadId"], start, end))

        def put(key: str, upload: str, number: int, data: memoryview) -> dict[str, Any]:
            asked = part_request(key, upload, number, data, WholeBody)
            return part_done(asked, sync.upload_part(**asked))

        sent = [
            (key, upload, [pool.submit(put, key, upload, n, d) for n, d in parts(start, end)])
            for key, upload, start, end in started
        ]
        for key, upload, futures in sent:
            done = {"Parts": [f.result() for f in futures]}
            sync.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=done
            )

    async def aio_object(key: str, start: int, end: int, slots: asyncio.Semaphore) -> None:
        made = await aio.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")
        upload = made["UploadId"]

        async def put(number: int, data: memoryview) -> dict[str, Any]:
            async with slots:
                asked = part_request(key, upload, number, data, StreamedBody)
                return part_done(asked, await aio.upload_part(**asked))

        done = await asyncio.gather(*(put(n, d) for n, d in parts(start, end)))
        await aio.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": list(done)}
        )

    async def aio_all() -> None:
        run, slots = next(runs), asyncio.Semaphore(in_flight)
        named = [(f"floor-save/{run}/{n}", start, end) for n, (start, end) in enumerate(objects)]
        keys.extend(key for key, _, _ in named)
        await asyncio.gather(*(aio_object(key, start, end, slots) for key, start, end in named))

    def aiohttp_save() -> None:
        loop.run_until_complete(aio_all())

    def forget() -> None:
        # The last run's objects, out of the timed span (RGW's test OSD is small).
        while keys:
            check.delete_object(Bucket=bucket, Key=keys.pop())

    rows: dict[str, Any] = {}
    try:
        for name, save in (
            ("floor_save_aiohttp", aiohttp_save),
            ("floor_save_sendall", sendall_save),
        ):
            rows[name] = measure(save, forget, repeats, list)
            for n, (start, end) in enumerate(objects):
                got = check.get_object(Bucket=bucket, Key=keys[n])["Body"].read()
                if got != blob[start:end]:
                    raise RuntimeError(f"{name}: object {n} stored wrong")
        forget()
    finally:
        pool.shutdown()
    return rows


def table(res: dict[str, Any]) -> str:
    gib = res["gib"]
    rows = [
        ("AWS s3torchconnector (CRT)", "s3tc_save", "s3tc_load"),
        ("AWS s3torchconnector, load into existing tensors", None, "s3tc_load_in_place"),
        ("objckpt", "objckpt_save", "objckpt_load"),
        ("objckpt, load into existing tensors", None, "objckpt_load_in_place"),
        ("objckpt, a new writer per save (warm process)", "objckpt_save_new_writer", None),
        ("objckpt, one GET per object (moto diagnostic)", None, "objckpt_load_whole_objects"),
        ("boto3 managed upload", "boto3_save", None),
        ("floor: aiohttp ranged GETs + CRC32C, into existing memory", None, "floor_load_aiohttp"),
        ("floor: http.client readinto + CRC32C, into existing memory", None, "floor_load_readinto"),
        ("floor: aiohttp multipart upload + CRC32C per part", "floor_save_aiohttp", None),
        ("floor: http.client sendall multipart + CRC32C per part", "floor_save_sendall", None),
        ("torch FsspecWriter/Reader", "fsspec_save", "fsspec_load"),
        ("objckpt async (commit / stall)", "objckpt_async", None),
        ("dcp.async_save thread (commit / stall)", "dcp_async", None),
        ("objckpt async, background staging (commit / stall)", "objckpt_async_bg", None),
        ("dcp.async_save, DefaultStager async staging (commit / stall)", "dcp_async_bg", None),
    ]
    lines = [
        "| method | save s | save CPU s/GiB | load s | load CPU s/GiB |",
        "|---|---|---|---|---|",
    ]
    if "s3tc_error" in res:
        lines.append(f"| AWS s3torchconnector (CRT) | failed: {res['s3tc_error']} | | | |")
    for name, save, load in rows:
        if save is None:
            if not (load and load in res):
                continue
            cells = [name, "", ""]
        elif save in res:
            s = res[save]
            wall = f"{s['wall_s']:.2f}" + (f" / {s['stall_s']:.3f}" if "stall_s" in s else "")
            cells = [name, wall, f"{s['cpu_s'] / gib:.1f}"]
        else:
            continue
        if load and load in res:
            cells += [f"{res[load]['wall_s']:.2f}", f"{res[load]['cpu_s'] / gib:.1f}"]
        else:
            cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += cold_rows(res)
    if "copy_limit_s" in res and "objckpt_async" in res:
        stall, copy = res["objckpt_async"]["stall_s"], res["copy_limit_s"]
        lines.append(
            f"default async stall {stall:.3f} s vs a plain copy into preallocated memory "
            f"{copy:.3f} s: {stall / copy:.2f}x"
        )
    for key in ("objckpt_async_bg", "dcp_async_bg"):
        if key in res:
            lines.append(f"{key}: staged {res[key]['staged_s']:.3f} s after the call")
    for key, name in (("objckpt_async", "objckpt async"), ("dcp_async", "dcp.async_save")):
        over = res.get(key, {}).get("pss_over_baseline")
        if over is not None:
            lines.append(
                f"{name}: peak tree PSS {over / 2**30:.2f} GiB over its baseline = "
                f"{over / 2**30 / gib:.2f}x the state (staging + 25% of state+staging = 1.50x)"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3tc-threads", type=int, default=8)
    parser.add_argument("--cold-runs", type=int, default=5)
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups")
    parser.add_argument("--fresh-clients", action="store_true")
    parser.add_argument(
        "--server", choices=("moto", "rgw"), default="moto", help="the S3 server to run against"
    )
    parser.add_argument(
        "--equal-tensors",
        type=int,
        default=0,
        help="a state of this many equal fp32 tensors instead of the transformer-shaped one",
    )
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(args, size_mib=4, repeats=1, cold_runs=1)
    warnings.filterwarnings("ignore")
    only = tuple(g for g in args.only.split(",") if g)
    unknown = sorted(set(only) - set(GROUPS))
    if unknown:
        parser.error(f"--only: unknown group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    res = run(
        args.size_mib,
        args.repeats,
        args.s3tc_threads,
        args.cold_runs,
        only,
        args.fresh_clients,
        args.server,
        args.equal_tensors,
    )
    fields = {
        "repeats": args.repeats,
        "only": list(only),
        "fresh_clients": args.fresh_clients,
        "equal_tensors": args.equal_tensors,
    }
    name = (
        "throughput"
        + ("-rgw" if args.server == "rgw" else "")
        + (f"-{args.tag}" if args.tag else "")
    )
    path = write_record(args.out, name, args.size_mib, {**fields, **res})
    print(table(res))
    print(f"\nrecorded in {path}")


if __name__ == "__main__":
    main()
