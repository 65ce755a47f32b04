"""One launcher for the tests that run real ranks, and the process group each rank joins.

A distributed test names a rank body (a module-level function, so that ``spawn``
can import it in a fresh interpreter) and runs it on ``world`` processes with
:func:`run_ranks`; the body calls :func:`init_ranks` first. Every rank-body module
used to carry its own copy of the entry point below; one copy keeps the exit path
(why ``os._exit``, see :func:`_rank_entry`) in one place.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from objckpt.testing import offline_env


def run_ranks(
    module: ModuleType, body: str | Callable[..., object], world: int, *args: Any
) -> None:
    """Run ``module.body(rank, world, *args)`` on ``world`` spawned processes and wait.

    ``body`` is the function or its name; it must be a module-level function of
    ``module``. A rank whose body raises fails the call with that rank's traceback
    (``torch.multiprocessing.spawn`` reports it), so a test's assertions made inside
    a rank fail the test.
    """
    name = body if isinstance(body, str) else body.__name__
    mp.spawn(_rank_entry, args=(module.__name__, name, world, *args), nprocs=world, join=True)


def _rank_entry(rank: int, module: str, body: str, world: int, *args: Any) -> None:
    """Run one rank's body, then leave without interpreter teardown.

    torch 2.13's gloo worker threads can abort the process while the interpreter
    finalizes ("terminate called without an active exception", SIGABRT; seen once
    in a fresh-clone CI run here), after the body has passed and destroyed its
    process group; that is torch's exit path, not the checkpoint under test. A failing
    body still raises, and spawn reports its traceback.
    """
    getattr(importlib.import_module(module), body)(rank, world, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
