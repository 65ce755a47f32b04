"""Entry point of a worker process (``python -m objckpt.pipeline._worker_main FD PID``).

Started by :class:`~objckpt.pipeline.workers.WorkerPool` with the socket ``FD`` it
talks over and the training process's ``PID`` (the worker exits when that process
does, :mod:`objckpt.pipeline.lifeline`). It runs one task at a time: a pickled
(function, arguments) in, (ok, result or exception, remote traceback) out. Imports
nothing but what the tasks name, so an upload worker never loads torch.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import traceback
from typing import Any

from objckpt.pipeline.upload_task import init_worker, on_pool_gone
from objckpt.pipeline.workers import Channel


def _reply(ok: bool, value: Any, remote: str) -> bytes:
    """The pickled reply; an exception that would not survive the trip is sent as
    a RuntimeError carrying its type and message."""
    try:
        data = pickle.dumps((ok, value, remote), protocol=pickle.HIGHEST_PROTOCOL)
        if not ok:
            pickle.loads(data)  # our own bytes: checks the exception rebuilds
        return data
    except Exception as exc:
        if ok:
            value = exc  # an unpicklable result is the task's error
            remote = traceback.format_exc()
        stand_in = RuntimeError(f"{type(value).__name__}: {value}")
        return pickle.dumps((False, stand_in, remote), protocol=pickle.HIGHEST_PROTOCOL)


def main(argv: list[str]) -> int:
    fd, parent = int(argv[1]), int(argv[2])
    # Ctrl-C reaches the whole process group; the training process handles it and
    # closes the pool, and a worker interrupted mid-upload would only report noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=fd))
    hello = channel.recv()
    sys.path[:] = hello["sys_path"]
    init_worker(parent)
    channel.send(os.getpid())
    while True:
        try:
            message = channel.recv_bytes()
        except (EOFError, OSError):
            on_pool_gone(parent)  # no goodbye: perhaps the training process died
            return 0
        try:
            task = pickle.loads(message)  # from the process that started us
            if task is None:
                return 0
            fn, args = task
            reply = _reply(True, fn(*args), "")
        except BaseException as exc:
            reply = _reply(False, exc, traceback.format_exc())
        channel.send_bytes(reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
