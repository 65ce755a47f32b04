"""Peak memory of one async save over its process's baseline, each method in a fresh process.

``bench_throughput.py`` measures memory after many other phases in one process, so
heap those phases left behind (and later returned to the system) moves its baseline.
Here every method runs in a process of its own: build the state dict, take the
baseline (PSS of the process, nothing else started), then run the method's first save
(which starts its workers and allocates its staging) and a second one, sampling the PSS
of the process and its children every 10 ms. The moto server is excluded.

* ``objckpt_async``: ``AsyncCheckpointer`` (default options);
* ``dcp_async``: ``dcp.async_save`` (thread executor) with ``FsspecWriter``.

Usage: ``python bench/bench_async_memory.py [--size-mib 256]``; results go to
``bench/results/async-memory-<date>-<size>mib.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import warnings

import smoke
from bench_throughput import TreeRss
from record import write_record

from objckpt.testing.servers import offline_env, s3_test_options, start_moto_server

log = logging.getLogger("bench")
METHODS = ("objckpt_async", "dcp_async")


def child(method: str, size_mib: int, endpoint: str, key: str, secret: str) -> dict[str, int]:
    """In the fresh process: baseline, then the peak over two saves."""
    import torch
    import torch.distributed.checkpoint as dcp
    from bench_sync import transformer_state
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import objckpt

    torch.set_num_threads(1)
    state = transformer_state(size_mib)
    opts = s3_test_options(endpoint, key, secret)
    fs_kwargs = {"endpoint_url": endpoint, "key": key, "secret": secret}
    tree = TreeRss(exclude=-1)
    base = tree.pss_now()
    with tree:
        if method == "objckpt_async":
            with objckpt.AsyncCheckpointer(storage_options=opts) as ckpt:
                for n in range(2):
                    ckpt.save(state, f"s3://bench/{method}-{n}").result(timeout=600)
        else:
            for n in range(2):
                dcp.async_save(
                    state,
                    storage_writer=FsspecWriter(
                        f"s3://bench/{method}-{n}", sync_files=False, **fs_kwargs
                    ),
                    async_checkpointer_type=AsyncCheckpointerType.THREAD,
                ).result()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"baseline_pss": base, "peak_pss": tree.peak_pss, "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    smoke.add_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.child:
        method, size, endpoint, key, secret = args.child
        print(json.dumps(child(method, int(size), endpoint, key, secret)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(args, size_mib=4)
    os.environ.update(offline_env())
    server = start_moto_server()
    out: dict[str, dict[str, float]] = {}
    try:
        server.boto3_client().create_bucket(Bucket="bench")
        for method in METHODS:
            argv = [method, str(args.size_mib), server.endpoint_url, server.key, server.secret]
            done = subprocess.run(
                [sys.executable, __file__, "--child", *argv],
                capture_output=True,
                text=True,
                check=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            )
            got = json.loads(done.stdout.strip().splitlines()[-1])
            over = got["peak_pss"] - got["baseline_pss"]
            out[method] = {**got, "pss_over_baseline": over, "x_state": over / got["state_bytes"]}
            log.info(
                "%s: %.2f GiB over baseline = %.2fx the state",
                method,
                over / 2**30,
                out[method]["x_state"],
            )
    finally:
        server.stop()
    path = write_record(args.out, "async-memory", args.size_mib, out)
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
