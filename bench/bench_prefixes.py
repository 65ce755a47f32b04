"""Requests per prefix: a simulated large job's saves and restore through S3's
per-partition request rates, modelled (#46).

S3 serves 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per partitioned
prefix and splits a busy key range gradually, answering 503 SlowDown meanwhile. This
bench puts :class:`objckpt.testing.throttle.PartitionModel` (the rates scaled down by
``--scale`` so two cores can drive them) in front of moto through the fault proxy, and
writes, step after step, the payload objects ``--ranks`` ranks would write (``--objects``
each, tiny: the request count is what is measured), then reads the last step back as a
restore would, from ``--threads`` client threads through objckpt's own ``ObjectStore``:
each write through its upload path (``begin``/``close``, holding one of the store's
``max_parts_in_flight`` slots, as a save's objects do), each read as one GET. Its
retries ride SlowDown out, and its back-off (:mod:`objckpt.writers.throttle`) halves
the requests in flight in a directory that was refused, and in all directories when
refusals span several. Key layouts compared:

* ``step``: objckpt's default, ``<root>/step-N/__<rank>_<i>.<attempt>.distcp``;
* ``entropy``: ``UploadOptions(prefix_entropy=1)``, ``<root>/step-N/<h>/__…``;
* ``spread``: ``UploadOptions(prefix_entropy=1, persistent_prefixes=True)``,
  ``<root>/spread-<h>/step-N/__…``: prefixes that persist across steps.

Each save's writes run inside a save deadline, as a save's uploads do (SlowDown is
waited out until it); the restore's reads run under the default ``RetryPolicy``, as a
load's do, whose ``attempts`` count 503 answers: a read that meets SlowDown six times
gives up (counted in "gave up"). Per layout and step: seconds, requests answered 503
(throttled), reads given up, partitions after the step, the client's back-off
(directory and client-wide halvings, where the client has one) and the most requests
one partition served in one second. Results go to
``bench/results/prefixes-<date>-0mib.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import time
import uuid
import warnings
from typing import Any

import smoke
from record import write_record

from objckpt import Location, UploadOptions
from objckpt.errors import StoreError
from objckpt.format.layout import payload_key
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.servers import offline_env, start_moto_server
from objckpt.testing.throttle import PartitionModel, PrefixRates
from objckpt.writers import open_store
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import placed

log = logging.getLogger("bench")
BUCKET = "bench-prefixes"
LAYOUTS = ("step", "entropy", "spread")


def key_of(layout: str, step: int, rank: int, index: int, attempt: str) -> str:
    """The key, under the root, of one payload object in ``layout``."""
    if layout == "step":
        return f"{step_name(step)}/{payload_key(rank, index, attempt)}"
    if layout == "entropy":
        return f"{step_name(step)}/{payload_key(rank, index, attempt, 1)}"
    return placed(step_name(step), payload_key(rank, index, attempt, 1, persistent=True))


def run_layout(proxy: FaultProxy, model: PartitionModel, layout: str, args: Any) -> dict[str, Any]:
    """Every step's writes, then the last step read back; per step and the restore."""
    root = f"s3://{BUCKET}/{layout}"
    store = open_store(Location.parse(root, proxy.storage_options()), UploadOptions())
    rows: list[dict[str, Any]] = []
    keys: list[str] = []

    def cuts() -> tuple[int, int]:
        backoff = getattr(store, "backoff", None)  # None: a client without one
        stats = backoff.stats() if backoff is not None else None
        if stats is not None:
            return stats.directory_cuts, stats.client_cuts
        # objckpt before #46 (for before/after runs): one limit on a store's uploads,
        # halved by any refused request of its client; counted as cuts of everything.
        limit = getattr(store, "limit", None)
        return (0, limit.stats().decreases) if hasattr(limit, "stats") else (0, 0)

    def timed(work: Any, items: list[str], threads: int) -> tuple[float, int]:
        """Seconds for ``work`` over ``items`` from ``threads`` threads, and how many failed."""
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            failed = sum(not ok for ok in pool.map(work, items))
        return time.perf_counter() - t0, failed

    def counters() -> tuple[int, int, int, tuple[int, int]]:
        return model.refused, model.refused_writes, model.splits, cuts()

    def row(label: str, items: list[str], took: tuple[float, int], before: Any) -> dict[str, Any]:
        refused, writes, splits, (dirs, client) = before
        after = cuts()
        return {
            "what": label,
            "requests": len(items),
            "seconds": took[0],
            "throttled": model.refused - refused,
            "throttled_writes": model.refused_writes - writes,
            "gave_up": took[1],
            "splits": model.splits - splits,
            "partitions": len(model.partitions),
            "directory_cuts": after[0] - dirs,
            "client_cuts": after[1] - client,
        }

    def measured(label: str, work: Any, items: list[str]) -> dict[str, Any]:
        before = counters()
        return row(label, items, timed(work, items, args.threads), before)

    def beside(new: list[str], old: list[str]) -> list[dict[str, Any]]:
        """A save of ``new`` while ``old`` is read back (a backup or an evaluation
        reading the last step from the job's own client): the save starts once the
        reads are being refused, and is timed alone; the rows share the window's
        counters (throttled: the save's row counts writes, the restore's reads)."""
        before = counters()
        with concurrent.futures.ThreadPoolExecutor(1) as side:
            reading = side.submit(timed, restore, old, args.read_threads)
            while model.refused == before[0] and not reading.done():
                time.sleep(0.01)  # a bench, not a test: wait for the reads to be refused
            saving = timed(save, new, args.threads)
            read = reading.result()
        out = [
            row("save beside restore", new, saving, before),
            row("restore beside save", old, read, before),
        ]
        writes = out[0]["throttled_writes"]
        out[0]["throttled"], out[1]["throttled"] = writes, out[1]["throttled"] - writes
        return out

    payload = b"x" * 64

    def save(key: str) -> bool:
        # As a save's uploads do: inside its deadline, where SlowDown is waited out.
        with bounded_by(Deadline.start(args.deadline, f"saving {root}")):
            upload = store.begin(key, len(payload))
            upload.write(payload)
            upload.close().result()
        return True

    def restore(key: str) -> bool:
        # As a load's reads do: the default RetryPolicy, whose `attempts` count 503s.
        try:
            store.read(key)
        except StoreError as exc:
            log.debug("gave up on %s: %s", key, exc)
            return False
        return True

    for step in range(1, args.steps + 1):
        attempt = uuid.uuid4().hex[:16]
        keys = [
            key_of(layout, step, r, i, attempt)
            for r in range(args.ranks)
            for i in range(args.objects)
        ]
        rows.append(measured(f"save {step}", save, keys))
        log.info("%s %s", layout, rows[-1])
    rows.append(measured("restore", restore, keys))
    log.info("%s %s", layout, rows[-1])
    if args.beside_ranks:
        attempt = uuid.uuid4().hex[:16]
        new = [
            key_of(layout, args.steps + 1, r, i, attempt)
            for r in range(args.beside_ranks)
            for i in range(args.objects)
        ]
        rows.extend(beside(new, keys))
        log.info("%s %s", layout, rows[-2:])
    return {"layout": layout, "rows": rows, "peak_per_partition_per_s": model.peak_per_second()}


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | what | requests | seconds | throttled (503) | gave up | partitions after "
        "| back-offs (directory / all) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["rows"]:
            lines.append(
                f"| {result['layout']} | {row['what']} | {row['requests']} "
                f"| {row['seconds']:.1f} | {row['throttled']} | {row['gave_up']} "
                f"| {row['partitions']} "
                f"| {row.get('directory_cuts', 0)} / {row.get('client_cuts', 0)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--objects", type=int, default=2, help="payload objects per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16, help="client threads (the job)")
    parser.add_argument(
        "--beside-ranks",
        type=int,
        default=0,
        help="then save this many ranks' objects of a new step while the last is read again",
    )
    parser.add_argument(
        "--read-threads", type=int, default=32, help="threads reading beside that save"
    )
    parser.add_argument("--scale", type=float, default=0.01, help="of S3's documented rates")
    parser.add_argument("--split-after", type=float, default=2.0)
    parser.add_argument(
        "--deadline", type=float, default=600.0, help="seconds each write may take, as in a save"
    )
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default="bench/results")
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(
        args, ranks=4, objects=4, steps=2, threads=4, scale=0.003, split_after=0.5, beside_ranks=2
    )
    logging.getLogger("objckpt").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.update(offline_env())
    rates = PrefixRates(scale=args.scale, split_after=args.split_after)
    server = start_moto_server()
    results = []
    try:
        server.boto3_client().create_bucket(Bucket=BUCKET)
        for layout in args.layouts.split(","):
            model = PartitionModel(rates)  # each layout on a fresh bucket's partitions
            with FaultProxy(server.endpoint_url, throttle=model) as proxy:
                results.append(run_layout(proxy, model, layout, args))
    finally:
        server.stop()
    print(table(results))
    fields = {
        "rates": {"writes": rates.writes * rates.scale, "reads": rates.reads * rates.scale},
        "split_after_s": rates.split_after,
        "ranks": args.ranks,
        "objects_per_rank": args.objects,
        "threads": args.threads,
        "results": results,
    }
    print(write_record(args.out, "prefixes", 0, fields))


if __name__ == "__main__":
    main()
