"""Child process for the gc test: commit step 1, start step 2, then wait to be SIGKILLed.

Run as a script in a process of its own, so the test can SIGKILL it. Prints
``committed`` after step 1 and ``uploading`` once step 2's save has returned, then
sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from objckpt import CheckpointManager, UploadOptions

MiB = 1024 * 1024


def state(step: int, tensors: int) -> dict:
    """``tensors`` fp32 tensors of 16 MiB: each one object, uploaded in 6 MiB parts."""
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(16 * MiB // 4, generator=g) for i in range(tensors)}


def main() -> None:
    root, options, tensors = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    upload = UploadOptions(part_size=5 * MiB, object_size=8 * MiB, max_parts_in_flight=1)
    mgr = CheckpointManager(root, storage_options=options, upload=upload)
    mgr.save(1, state(1, 1)).result(timeout=120)
    print("committed", flush=True)
    mgr.save(2, state(2, tensors))
    print("uploading", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
