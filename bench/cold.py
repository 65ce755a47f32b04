"""The cold column of ``bench_throughput.py``: each sync save in a fresh process.

``run_cold`` writes the state once with ``torch.save`` and spawns ``cold_save.py``
per measured save, the methods alternating (objckpt, then s3torchconnector where it
is installed), each against a just-reset moto bucket; ``cold_rows`` formats the cold
and warm figures side by side. ``no_client_cache`` gives the "before" figures of
``--fresh-clients``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import torch

from objckpt.testing.servers import MotoServer

__all__ = ["cold_rows", "fresh_bucket", "no_client_cache", "run_cold"]

log = logging.getLogger("bench")


def no_client_cache() -> None:
    """Every writer, reader and store builds its own client, as before objckpt's
    per-process client cache: the "before" figures of ``--fresh-clients``."""
    from objckpt.writers.clients import PROCESS_CLIENTS

    PROCESS_CLIENTS.filesystem = lambda location: location.open_fs(fresh=True)  # type: ignore[method-assign]


def fresh_bucket(server: Any, client: Any, n: int) -> str:
    """An empty bucket for the next measured run: moto is reset (its reset API), a real
    server (Ceph RGW, ``--server rgw``) gets a new bucket, since it has no reset."""
    if isinstance(server, MotoServer):
        server.reset()
        client.create_bucket(Bucket="bench")
        return "bench"
    name = f"bench-{n}"
    client.create_bucket(Bucket=name)
    return name


def run_cold(
    server: Any, state: dict[str, torch.Tensor], runs: int, threads: int
) -> dict[str, Any]:
    """Each save in a fresh process (``cold_save.py``), the methods alternating;
    medians over ``runs`` and every run's figures."""
    client = server.boto3_client()
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cold_save.py")
    endpoint = server.storage_options()["endpoint_url"]
    runs_by: dict[str, list[dict[str, Any]]] = {"objckpt_save": [], "s3tc_save": []}
    methods = [("objckpt_save", "objckpt")]
    try:
        import s3torchconnector  # noqa: F401
    except ImportError:
        log.warning("s3torchconnector is not installed (pip install '.[bench]'): no cold peer")
    else:
        methods.append(("s3tc_save", "s3tc"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        torch.save(state, path)
        for i in range(runs):
            for name, method in methods:
                bucket = fresh_bucket(server, client, 1000 + len(methods) * i + len(runs_by))
                url = f"s3://{bucket}/cold-{method}-{i}"
                done = subprocess.run(
                    [sys.executable, child, method, endpoint, url, path, str(threads)],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"cold {method} run {i} failed:\n{done.stderr[-3000:]}")
                runs_by[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                log.info("cold %s run %d: %s", method, i, runs_by[name][-1])
    out: dict[str, Any] = {"runs": runs}
    for name, rows in runs_by.items():
        if rows:
            out[name] = {
                k: statistics.median(r[k] for r in rows)
                for k in ("cpu_s", "wall_s", "import_cpu_s", "gc_cpu_s", "process_cpu_s")
            }
            out[name]["each"] = rows
    return out


def cold_rows(res: dict[str, Any]) -> list[str]:
    """Markdown lines: cold and warm sync saves side by side, and their CPU ratio."""
    cold, gib = res.get("cold", {}), res["gib"]
    if not cold.get("objckpt_save"):
        return []
    lines = [
        "",
        f"sync save, cold (a fresh process per save, median of {cold['runs']}) "
        "and warm (client reused):",
        "| method | cold s | cold CPU s/GiB | of which import + writer CPU s "
        "| GC CPU s | warm s | warm CPU s/GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, key in (("AWS s3torchconnector (CRT)", "s3tc_save"), ("objckpt", "objckpt_save")):
        c, w = cold.get(key), res.get(key)
        if c is None:
            continue
        warm = [f"{w['wall_s']:.2f}", f"{w['cpu_s'] / gib:.2f}"] if w else ["", ""]
        lines.append(
            f"| {name} | {c['wall_s']:.2f} | {c['cpu_s'] / gib:.2f} | "
            f"{c['import_cpu_s']:.3f} | {c['gc_cpu_s']:.3f} | " + " | ".join(warm) + " |"
        )
    if cold.get("s3tc_save"):
        ratio = cold["objckpt_save"]["cpu_s"] / cold["s3tc_save"]["cpu_s"]
        lines.append(f"cold save CPU/GiB, objckpt vs s3torchconnector: {ratio:.2f}x")
    return lines
