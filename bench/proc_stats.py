"""What ``bench_throughput.py`` measures a method with: CPU of a process tree from
/proc, peak RSS and PSS of this process and its children, and the median of runs.

Split out of ``bench_throughput.py`` (whose ``TreeRss`` ``bench_async_memory.py``
also uses) so that each benchmark module stays one job.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Collections", "TreeRss", "measure"]

_TICK = os.sysconf("SC_CLK_TCK")


class Collections:
    """Python's garbage collections while open (a ``gc.callbacks`` entry): how many
    of each generation, and the wall and CPU seconds they took. A full collection
    walks every object the process holds and holds the GIL meanwhile, so it says why
    one save's stall or commit differs from another's, where a median hides it."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self._started = (0.0, 0.0)

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)

    @property
    def full(self) -> int:
        """Full (generation-2) collections so far."""
        return self.count[2]

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.perf_counter(), time.process_time())
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started[0]
            self.cpu_seconds += time.process_time() - self._started[1]

    def summary(self) -> dict[str, Any]:
        return {"collections": list(self.count), "seconds": self.seconds}


def _proc_cpu(pid: int) -> float:
    """user+sys seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except OSError:
        return 0.0


def _kib_field(path: str, field: str) -> int:
    """Bytes of a ``Field:  N kB`` line of a /proc file (0 once the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss(pid: int) -> int:
    return _kib_field(f"/proc/{pid}/status", "VmRSS:")


def _pss(pid: int) -> int:
    """Proportional set size: shared pages (the staging segment) split between the
    processes that map them, so a tree's sum counts them once."""
    return _kib_field(f"/proc/{pid}/smaps_rollup", "Pss:")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


class TreeRss:
    """Peak RSS of this process and its descendants (``exclude`` left out)."""

    def __init__(self, exclude: int) -> None:
        self.exclude = exclude
        self.peak = 0
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[int]:
        pids, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid == self.exclude:
                continue
            pids.append(pid)
            todo += _children(pid)
        return pids

    def pss_now(self) -> int:
        return sum(_pss(p) for p in self._tree())

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            tree = self._tree()
            self.peak = max(self.peak, sum(_rss(p) for p in tree))
            self.peak_pss = max(self.peak_pss, sum(_pss(p) for p in tree))

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(
    fn: Callable[[], Any],
    setup: Callable[[], Any],
    repeats: int,
    extra_pids: Callable[[], list[int]],
) -> dict[str, float]:
    """Median wall and CPU seconds of ``fn`` after one untimed warm-up run."""
    setup()
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        setup()
        pids = extra_pids()
        c0 = time.process_time() + sum(_proc_cpu(p) for p in pids)
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() + sum(_proc_cpu(p) for p in pids) - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
