"""One place that writes a benchmark's result file, so every record carries the
same header: which benchmark, when, on what machine, with which versions."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import torch

import objckpt


def write_record(out_dir: str, name: str, size_mib: int, fields: dict[str, Any]) -> str:
    """Write ``<out_dir>/<name>-<date>-<size>mib.json`` and return its path."""
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "objckpt_version": objckpt.__version__,
        **fields,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{datetime.date.today().isoformat()}-{size_mib}mib.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path
