"""Nothing outlives a killed training process: its upload workers and its staging memory.

A training process can die by SIGKILL (the OOM killer, a scheduler's hard stop)
with no chance to clean up. Two things would then linger on the node:

* Upload workers. An idle worker sees its socket to the pool close and exits,
  but a worker in the middle of an upload would finish it (and a worker whose
  pool's process is frozen would wait forever). Each worker therefore also
  watches the training process and exits when it is gone (:func:`watch_parent`).
* Staging segments: files in the staging directory (``/dev/shm`` unless
  ``AsyncOptions.staging_dir`` names another; host memory, as large as the state
  dict) that only the dead process would have unlinked. A watching worker unlinks
  the segments it had mapped (by path, wherever they lie); the next
  :class:`~objckpt.pipeline.stage.Stager` on the node removes any left by dead
  processes (:func:`sweep_stale_segments`) in the default directory and in its own,
  so a job that names a directory sweeps what its killed predecessor left there.

Segment names carry the pid namespace and the pid of their owner
(``objckpt-<ns>-<pid>-<random>``), so the sweep only judges processes it can see:
containers sharing ``/dev/shm`` but not a pid namespace never remove each other's.
"""

from __future__ import annotations

import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable

__all__ = ["segment_prefix", "sweep_stale_segments", "wait_for_exit", "watch_parent"]

logger = logging.getLogger(__name__)

_SEGMENT = re.compile(r"^objckpt-(\d+)-(\d+)-")
_POLL_SECONDS = 1.0


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def segment_prefix() -> str:
    """The file-name prefix of this process's staging segments."""
    return f"objckpt-{_pid_namespace()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep_stale_segments(directory: str | None) -> list[str]:
    """Unlink staging segments in ``directory`` whose owner (same pid namespace) has
    exited; returns their paths. Mappings still open elsewhere stay valid until
    closed; only the names go."""
    if directory is None or not os.path.isdir(directory):
        return []
    ours = _pid_namespace()
    removed: list[str] = []
    for name in os.listdir(directory):
        match = _SEGMENT.match(name)
        if match is None or match.group(1) != ours or _alive(int(match.group(2))):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue  # raced with another sweeper, or not ours to remove
        removed.append(path)
    if removed:
        logger.warning(
            "removed %d staging segment(s) left in %s by exited processes", len(removed), directory
        )
    return removed


def wait_for_exit(pid: int, timeout: float | None = None) -> bool:
    """Block until process ``pid`` has exited (a pidfd where Linux offers one) or
    ``timeout`` seconds have passed; True if it exited. An exited process counts
    even before its parent reaps it."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return True
        except OSError:
            fd = None  # kernel without pidfd: poll instead
        if fd is not None:
            try:
                readable, _, _ = select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
            return bool(readable)
    deadline = None if timeout is None else time.monotonic() + timeout
    while _alive(pid):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def watch_parent(parent_pid: int, on_exit: Callable[[], None]) -> threading.Thread:
    """In a worker: when ``parent_pid`` exits, run ``on_exit`` and end this process.

    ``os._exit`` rather than ``sys.exit``: the worker's main thread is blocked in
    a pipe read that no exception in this thread could interrupt.
    """

    def watch() -> None:
        wait_for_exit(parent_pid)
        try:
            on_exit()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="objckpt-lifeline", daemon=True)
    thread.start()
    return thread
