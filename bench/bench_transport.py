"""S3 transport evaluation: objckpt's s3fs path against obstore's Rust client.

Issue #13 asks whether a faster S3 client behind the same seam should replace s3fs.
This measures the transport alone, in one run, against one moto server process: the
same bytes (random, held in memory) uploaded as one object in 16 MiB parts with 8
parts in flight, and read back with 16 MiB ranged GETs, 8 in flight:

* ``s3fs``: objckpt's own ``S3Store`` upload (s3fs/aiobotocore; each part sent with
  its CRC32C, which S3 verifies) and fsspec ``cat_ranges`` for reads;
* ``obstore``: ``obstore.put`` (multipart, ``chunk_size``/``max_concurrency`` as above)
  and ``obstore.get_ranges``.

Medians of ``--repeats`` after one warm-up each; client CPU is this process's user +
system time (every thread, the Rust runtime's included) per GiB. It also records which
of objckpt's guarantees each client can keep (create-only commit, abort on failure,
per-part CRC32C): the adoption rule is "only if it wins on wall time *and* CPU per GiB
and keeps every guarantee".

Usage: ``python bench/bench_transport.py [--size-mib 256] [--repeats 3]`` (needs the
``bench`` extra for obstore).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import smoke
from record import write_record

from objckpt import Location
from objckpt.options import UploadOptions
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.servers import MotoServer, offline_env, start_moto_server
from objckpt.writers import open_store

log = logging.getLogger("bench")
MiB = 1024 * 1024
PART = 16 * MiB
IN_FLIGHT = 8
BUCKET = "transport"


def measure(fn: Callable[[], Any], repeats: int, gib: float) -> dict[str, float]:
    fn()  # warm: connections, clients
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "wall_s": statistics.median(walls),
        "cpu_s_per_gib": statistics.median(cpus) / gib,
        "gib_per_s": gib / statistics.median(walls),
    }


def _obstore(endpoint: str, opts: dict[str, Any]) -> Any:
    from obstore.store import S3Store as ObS3

    return ObS3(
        BUCKET,
        endpoint=endpoint,
        access_key_id=opts["key"],
        secret_access_key=opts["secret"],
        region="us-east-1",
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )


def guarantees(server: MotoServer, with_obstore: bool = True) -> dict[str, dict[str, Any]]:
    """Which guarantees each client keeps, checked against the same moto server
    (objckpt's alone without obstore: a smoke run where the ``bench`` extra is missing)."""
    out: dict[str, dict[str, Any]] = {"s3fs": {}, "obstore": {}} if with_obstore else {"s3fs": {}}
    opts = server.storage_options()
    store = open_store(Location.parse(f"s3://{BUCKET}/g", opts), UploadOptions(part_size=5 * MiB))
    try:
        # Create-only: a second create of the same key is refused.
        store.create("m.json", b"1")
        try:
            store.create("m.json", b"2")
            out["s3fs"]["create_only"] = False
        except FileExistsError:
            out["s3fs"]["create_only"] = True
        if with_obstore:
            import obstore

            ob = _obstore(server.endpoint_url, opts)
            obstore.put(ob, "g/o.json", b"1", mode="create")
            try:
                obstore.put(ob, "g/o.json", b"2", mode="create")
                out["obstore"]["create_only"] = False
            except Exception as exc:  # obstore's AlreadyExistsError
                out["obstore"]["create_only"] = "AlreadyExists" in type(exc).__name__
    finally:
        store.close()
    # Abort on failure: a multipart upload whose 2nd part fails is aborted, not left open.
    with FaultProxy(server.endpoint_url) as proxy:
        popts = proxy.storage_options()
        proxy.add(Rule("UploadPart", key_contains="partNumber=2", action="status", status=400))
        data = os.urandom(20 * MiB)
        client = server.boto3_client()

        def left_open(prefix: str) -> int:
            ups = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
            return len(ups)

        pstore = open_store(
            Location.parse(f"s3://{BUCKET}/fail-s3fs", popts), UploadOptions(part_size=5 * MiB)
        )
        try:
            up = pstore.begin("x", len(data))
            try:
                up.write(data)
                up.close().result()
            except Exception:
                up.abort()
        finally:
            pstore.close()
        out["s3fs"]["aborts_on_failure"] = left_open("fail-s3fs/") == 0
        out["s3fs"]["sends_part_crc32c"] = True  # tests/store/test_s3_multipart.py proves it
        if not with_obstore:
            return out
        import obstore

        try:
            obstore.put(
                _obstore(proxy.endpoint_url, popts),
                "fail-ob/x",
                data,
                use_multipart=True,
                chunk_size=5 * MiB,
            )
            out["obstore"]["failed_part_raised"] = False
        except Exception:
            out["obstore"]["failed_part_raised"] = True
        out["obstore"]["aborts_on_failure"] = left_open("fail-ob/") == 0
        crcs = [dict(s.amz).get("x-amz-checksum-crc32c") for s in proxy.seen]
        out["obstore"]["sends_part_crc32c"] = any(crcs[-3:])
    return out


def run(size_mib: int, repeats: int, with_obstore: bool = True) -> dict[str, Any]:
    os.environ.update(offline_env())
    server = start_moto_server()
    try:
        server.boto3_client().create_bucket(Bucket=BUCKET)
        opts = server.storage_options()
        data = os.urandom(size_mib * MiB)
        gib = len(data) / 2**30
        store = open_store(
            Location.parse(f"s3://{BUCKET}/s3fs", opts),
            UploadOptions(part_size=PART, max_parts_in_flight=IN_FLIGHT),
        )
        ob = _obstore(server.endpoint_url, opts) if with_obstore else None
        view = memoryview(data)

        def s3fs_put() -> None:
            up = store.begin("obj", len(data))
            for at in range(0, len(data), 4 * MiB):  # as torch.save hands bytes over
                up.write(view[at : at + 4 * MiB])
            up.close().result()

        def obstore_put() -> None:
            obstore.put(
                ob,
                "ob/obj",
                data,
                use_multipart=True,
                chunk_size=PART,
                max_concurrency=IN_FLIGHT,
            )

        starts = list(range(0, len(data), PART))
        ends = [min(s + PART, len(data)) for s in starts]
        path = store.path("obj")

        def s3fs_get() -> None:
            blobs = store._fs.cat_ranges([path] * len(starts), starts, ends)
            assert sum(len(b) for b in blobs) == len(data)

        def obstore_get() -> None:
            blobs = obstore.get_ranges(ob, "ob/obj", starts=starts, ends=ends)
            assert sum(len(b) for b in blobs) == len(data)

        res: dict[str, Any] = {"bytes": len(data)}
        res["s3fs_put"] = measure(s3fs_put, repeats, gib)
        res["s3fs_get"] = measure(s3fs_get, repeats, gib)
        if with_obstore:
            import obstore

            res["obstore_put"] = measure(obstore_put, repeats, gib)
            res["obstore_get"] = measure(obstore_get, repeats, gib)
        store.close()
        res["guarantees"] = guarantees(server, with_obstore)
        return res
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(args, size_mib=20, repeats=1)
    warnings.filterwarnings("ignore")
    with_obstore = smoke.installed("obstore", "obstore's rows")
    if not with_obstore and not args.smoke:
        return  # nothing to compare (a smoke run still runs objckpt's side)
    res = run(args.size_mib, args.repeats, with_obstore)
    path = write_record(args.out, "transport", args.size_mib, {"repeats": args.repeats, **res})
    print("| client | put s | put CPU s/GiB | get s | get CPU s/GiB |")
    print("|---|---|---|---|---|")
    for name in res["guarantees"]:
        p, g = res[f"{name}_put"], res[f"{name}_get"]
        print(
            f"| {name} | {p['wall_s']:.2f} | {p['cpu_s_per_gib']:.2f} | "
            f"{g['wall_s']:.2f} | {g['cpu_s_per_gib']:.2f} |"
        )
    print(f"guarantees: {res['guarantees']}")
    print(f"\nrecorded in {path}")


if __name__ == "__main__":
    main()
