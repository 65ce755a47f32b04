"""One launcher for the tests that run real ranks, and the process group each rank joins.

A distributed test names a rank body (a module-level function, so that a fresh
rank process can import it by name) and runs it on ``world`` processes with
:func:`run_ranks` (or :func:`start_ranks`, to watch each rank's exit); the body
calls :func:`init_ranks` first. Every rank-body module
used to carry its own copy of the entry point below; one copy keeps the exit path
(why ``os._exit``, see :func:`_rank_entry`) in one place.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing.connection
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from objckpt.testing import offline_env

# What every rank imports before or while its body runs: torch, its distributed
# checkpoint stack, torch._dynamo (``distribute_tensor`` imports it on first call),
# objckpt's writer, reader, checkpointer and manager, and s3fs cost about 6 CPU-s a
# process on the test machine, paid once by the fork server instead of once per rank
# (a suite starts some hundreds of ranks). Some of these read the environment when
# imported (torch: TORCH_LOGS; fsspec: FSSPEC_*; OpenMP: OMP_*): the server keeps the
# environment of the first test that started ranks, so a test that needs one of those
# set in its ranks must not rely on the preload (none does). gcsfs reads its probe
# switch at import, so it is left to the rank.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch._dynamo",
    "s3fs",
    "objckpt.testing",
    "objckpt.dcp.storage_writer",
    "objckpt.dcp.storage_reader",
    "objckpt.pipeline.checkpointer",
    "objckpt.ops.run.manager",
)


def start_ranks(
    module: ModuleType, body: str | Callable[..., object], world: int, *args: Any
) -> mp.ProcessContext:
    """Start ``module.body(rank, world, *args)`` on ``world`` processes; do not wait.

    For the tests that read each rank's exit code (a rank killed on purpose, a rank
    that must not hang): join ``.processes`` with a timeout. :func:`run_ranks` is the
    common case.

    Why ``forkserver``, not ``spawn``: each rank is forked from a server that has
    imported :data:`PRELOAD` once, so a rank starts in milliseconds instead of
    re-importing torch, and is still a fresh process with its own gloo group, state
    and exit. What the server cannot know is the test's environment at this moment
    (it keeps the one it started with), so the rank is handed ``os.environ`` and
    takes it as its own before the body's module is imported.
    """
    name = body if isinstance(body, str) else body.__name__
    mp.set_forkserver_preload(list(PRELOAD))
    return mp.start_processes(
        _rank_entry,
        args=(dict(os.environ), module.__name__, name, world, *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )


def run_ranks(
    module: ModuleType, body: str | Callable[..., object], world: int, *args: Any
) -> None:
    """Run ``module.body(rank, world, *args)`` on ``world`` processes and wait.

    ``body`` is the function or its name; it must be a module-level function of
    ``module``. A rank whose body raises fails the call with that rank's traceback
    (``torch.multiprocessing`` reports it), so a test's assertions made inside a
    rank fail the test.
    """
    context = start_ranks(module, body, world, *args)
    while not context.join():
        pass


def _rank_entry(
    rank: int, environ: dict[str, str], module: str, body: str, world: int, *args: Any
) -> None:
    """Take the test's environment, run one rank's body, then leave without
    interpreter teardown.

    torch 2.13's gloo worker threads can abort the process while the interpreter
    finalizes ("terminate called without an active exception", SIGABRT; seen once
    in a fresh-clone CI run here), after the body has passed and destroyed its
    process group; that is torch's exit path, not the checkpoint under test. A failing
    body still raises, and torch.multiprocessing reports its traceback.
    """
    os.environ.clear()
    os.environ.update(environ)
    threading.Thread(target=_exit_with_the_test, daemon=True).start()
    getattr(importlib.import_module(module), body)(rank, world, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_the_test() -> None:
    """Exit once the test's process is gone. A spawned rank died with its parent
    (torch asks the kernel for a signal then); a forked one's parent is the fork
    server, which outlives a killed pytest, so the rank watches the test's end of
    the pipe it was started through instead."""
    parent = mp.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def init_ranks(rank: int, world: int, init_file: str) -> Any:
    """Join a gloo group of ``world`` ranks through ``init_file``; a 1-D CPU mesh.

    The environment is the offline one (no cloud credentials or metadata servers),
    one torch thread per rank (the ranks share the test machine's cores), and torch's
    warnings silenced: pytest's warning filters do not reach a spawned rank.
    """
    os.environ.update(offline_env())
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("OBJCKPT_DEBUG") else logging.WARNING,
        format=f"[r{rank}] %(asctime)s %(name)s %(message)s",
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))
