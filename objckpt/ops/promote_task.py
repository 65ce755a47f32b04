"""What a promotion worker process runs: copy one object local tier -> primary.

Torch-free, like :mod:`objckpt.pipeline.upload_task`: a promotion worker imports
the store layer and the object copy only.
"""

from __future__ import annotations

from objckpt.format.manifest import ObjectEntry
from objckpt.ops.verify import copy_object
from objckpt.options import UploadOptions
from objckpt.pipeline.upload_task import worker_store
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.location import Location

__all__ = ["promote_object"]


def promote_object(
    src: Location, dst: Location, options: UploadOptions, entry: ObjectEntry
) -> RequestStats:
    """Worker side: copy one object from the local tier to the primary, checked
    against ``entry`` while it streams (a damaged local copy is never committed)."""
    with counting(RequestCounter()) as counter:
        copy_object(worker_store(src, options), worker_store(dst, options), entry, None)
    return counter.snapshot()
