"""A save under injected throttling: 5% of requests answered 503 SlowDown.

Both series go through the same FaultProxy in front of one moto server (the
proxy's own cost is in both), alternating clean and faulty runs so drift on a
busy machine hits both alike. Reports the median save time of each and the
slowdown, the 503s injected, and the retries and concurrency back-offs seen.

Usage: ``python bench/bench_faults.py [--size-mib 1024] [--repeats 3] [--rate 0.05]``
Results go to ``bench/results/faults-<date>-<size>mib.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import smoke
from bench_sync import nbytes, transformer_state
from record import write_record

import objckpt
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.servers import offline_env, start_moto_server

log = logging.getLogger("bench")


class _Count(logging.Handler):
    """Counts objckpt's retry and back-off log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.retries = 0
        self.backoffs = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.retries += msg.startswith("retrying ")
        self.backoffs += msg.startswith("store throttling")


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(offline_env())
    state = transformer_state(args.size_mib)
    size = nbytes(state)
    server = start_moto_server()
    counter = _Count()
    logging.getLogger("objckpt").addHandler(counter)
    series: dict[str, list[float]] = {"clean": [], "faulty": []}
    injected: list[int] = []
    retries: list[int] = []
    backoffs: list[int] = []
    try:
        server.boto3_client().create_bucket(Bucket="bench")
        with FaultProxy(server.endpoint_url, seed=11) as proxy:
            opts = proxy.storage_options()
            n = 0
            for _ in range(args.repeats):
                for kind in ("clean", "faulty"):
                    n += 1
                    proxy.clear()
                    if kind == "faulty":
                        proxy.add(Rule(probability=args.rate, action="status", status=503))
                    counter.retries = counter.backoffs = 0
                    writer = objckpt.ObjectStoreWriter(
                        f"s3://bench/run/{kind}-{n}", storage_options=opts
                    )
                    t0 = time.perf_counter()
                    dcp.save(state, storage_writer=writer, no_dist=True)
                    series[kind].append(time.perf_counter() - t0)
                    if kind == "faulty":
                        injected.append(sum(1 for s in proxy.seen if s.fault))
                        retries.append(counter.retries)
                        backoffs.append(counter.backoffs)
                    log.info("%s save %.2f s", kind, series[kind][-1])
                    server.reset()
                    server.boto3_client().create_bucket(Bucket="bench")
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in series.items()}
    return {
        "bytes": size,
        "rate": args.rate,
        "repeats": args.repeats,
        "runs_seconds": series,
        "median_seconds": med,
        "slowdown": med["faulty"] / med["clean"],
        "injected_503s": injected,
        "retries": retries,
        "concurrency_backoffs": backoffs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=0.05)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smoke.apply(args, size_mib=4, repeats=1)
    logging.getLogger("objckpt").setLevel(logging.INFO)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    record = run(args)
    path = write_record(args.out, "faults", args.size_mib, record)
    med = record["median_seconds"]
    print("| series | median s | MB/s |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {record['bytes'] / v / 1e6:.0f} |")
    print(
        f"\n- slowdown with {args.rate:.0%} 503s: {record['slowdown']:.2f}x "
        f"(503s injected per save: {record['injected_503s']}, retries: {record['retries']}, "
        f"concurrency back-offs: {record['concurrency_backoffs']})"
    )
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
