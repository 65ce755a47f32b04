"""Entry point of a worker process (``python -m objckpt.pipeline._worker_main FDS PID``).

Started by :class:`~objckpt.pipeline.workers.WorkerPool` with the sockets ``FDS``
(comma-separated) it talks over and the training process's ``PID`` (the worker
exits when that process does, :mod:`objckpt.pipeline.lifeline`). Each socket is a
slot served by a thread of its own, one task at a time: a pickled (function,
arguments) in, (ok, result or exception, remote traceback) out. Uploads spend their
time waiting on the store, so two slots in one interpreter keep as many requests in
flight as two processes would, for one interpreter's memory. Imports nothing but
what the tasks name, so an upload worker never loads torch.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
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
    fds, parent = [int(fd) for fd in argv[1].split(",")], int(argv[2])
    # Ctrl-C reaches the whole process group; the training process handles it and
    # closes the pool, and a worker interrupted mid-upload would only report noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channels = [Channel(socket.socket(fileno=fd)) for fd in fds]
    hello = channels[0].recv()
    sys.path[:] = hello["sys_path"]
    init_worker(parent)
    # The process ends when every slot has had the pool's goodbye (or lost the pool).
    slots = [
        threading.Thread(target=_serve, args=(ch, parent), name=f"objckpt-slot-{n}")
        for n, ch in enumerate(channels[1:], start=1)
    ]
    for slot in slots:
        slot.start()
    _serve(channels[0], parent)
    for slot in slots:
        slot.join()
    return 0


def _serve(channel: Channel, parent: int) -> None:
    """One slot: say it is up, then run tasks until the pool says goodbye or is gone."""
    channel.send(os.getpid())
    while True:
        try:
            message = channel.recv_bytes()
        except (EOFError, OSError):
            on_pool_gone(parent)  # no goodbye: perhaps the training process died
            return
        try:
            task = pickle.loads(message)  # from the process that started us
            if task is None:
                return
            fn, args = task
            reply = _reply(True, fn(*args), "")
        except BaseException as exc:
            reply = _reply(False, exc, traceback.format_exc())
        try:
            channel.send_bytes(reply)
        except OSError:
            on_pool_gone(parent)
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv))
