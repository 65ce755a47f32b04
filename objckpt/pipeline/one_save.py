"""``objckpt.async_save``: one save, on a checkpointer of the caller's or a one-off.

Kept apart from :mod:`objckpt.pipeline.checkpointer` (the long-lived object) because
the one-off case owns a checkpointer's whole life: built for one save, closed when
that save ends.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from objckpt.pipeline.checkpointer import AsyncCheckpointer
from objckpt.pipeline.handle import SaveHandle

__all__ = ["async_save"]


def async_save(
    state_dict: dict[str, Any],
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any | None = None,
    checkpointer: AsyncCheckpointer | None = None,
    overwrite: bool = False,
    no_dist: bool = False,
    **kwargs: Any,
) -> SaveHandle:
    """Save asynchronously; returns a handle as soon as ``state_dict`` is staged.

    Pass a long-lived ``checkpointer`` to reuse staging memory and worker
    processes across saves (the fast path). Without one, a checkpointer is built
    for this save and closed when it finishes.

    Args:
        no_dist: This process alone, without a collective (see
            :meth:`AsyncCheckpointer.save`).
        kwargs: ``upload``, ``async_options`` and ``on_commit`` for the one-off checkpointer.
    """
    if checkpointer is not None:
        return checkpointer.save(
            state_dict, url, process_group=process_group, overwrite=overwrite, no_dist=no_dist
        )
    ckpt = AsyncCheckpointer(storage_options=storage_options, **kwargs)
    try:
        handle = ckpt.save(
            state_dict, url, process_group=process_group, overwrite=overwrite, no_dist=no_dist
        )
    except BaseException:
        ckpt.close()
        raise
    handle.add_done_callback(lambda _: threading.Thread(target=ckpt.close, daemon=True).start())
    return handle
