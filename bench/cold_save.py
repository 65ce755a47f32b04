"""One cold save in this fresh process: what a new writer pays once, then the save.

Run by ``bench_throughput.py`` as a subprocess per measured save (never imported
there): it loads the state dict the parent wrote with ``torch.save``, then measures
from before the library's import (objckpt or s3torchconnector) to the end of
``dcp.save``: the import, the writer and its client, and the save. torch's own
import and the state's load are outside the span (both methods pay them alike).
Client CPU is user+sys of this process and its children (``getrusage``).

Usage (by the parent): ``python cold_save.py METHOD ENDPOINT URL STATE_PATH THREADS``
with METHOD ``objckpt`` or ``s3tc``; prints one JSON object.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from proc_stats import Collections


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    method, endpoint, url, state_path, threads = sys.argv[1:6]
    torch.set_num_threads(1)
    state = torch.load(state_path, weights_only=True)
    c0, t0 = _cpu(), time.perf_counter()
    with Collections() as collections:
        if method == "objckpt":
            import objckpt

            writer = objckpt.ObjectStoreWriter(url, storage_options={"endpoint_url": endpoint})
            imported = _cpu()
            dcp.save(state, storage_writer=writer)
        else:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp import S3StorageWriter
            from s3torchconnector.dcp.s3_file_system import S3FileSystem

            imported = _cpu()
            config = S3ClientConfig(force_path_style=True)
            w = S3StorageWriter("us-east-1", url, s3client_config=config, thread_count=int(threads))
            client = S3Client("us-east-1", endpoint=endpoint, s3client_config=config)
            w.fs = S3FileSystem("us-east-1", s3_client=client)
            w.path = w.fs.init_path(url)
            dcp.save(state, storage_writer=w)
        cpu, wall = _cpu() - c0, time.perf_counter() - t0
    print(
        json.dumps(
            {
                "cpu_s": cpu,
                "wall_s": wall,
                "import_cpu_s": imported - c0,
                "gc_cpu_s": collections.cpu_seconds,
                "gc_collections": collections.count,
                "process_cpu_s": _cpu(),
            }
        )
    )


if __name__ == "__main__":
    main()
