"""The smoke mode every benchmark entry point takes: ``--smoke``.

A benchmark is run by hand, rarely, so a rename in objckpt used to break one silently
until the next person ran it. With ``--smoke`` each entry point runs its whole code
path once at tiny sizes, in seconds, and ``tests/bench/test_bench_smoke.py`` runs every
one of them in ``make test``. Smoke figures mean nothing: they are written under a fresh
temporary directory, never to ``bench/results``. A peer that is not installed (the
``bench`` extra: s3torchconnector, obstore) is skipped with a logged line, as is a
benchmark that needs a GPU or torchtitan where there is none.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import tempfile
from typing import Any

log = logging.getLogger("bench")
_active = False


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--smoke`` to a benchmark's parser."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, one run, results to a temporary directory (a CI check, not a "
        "measurement)",
    )


def apply(args: argparse.Namespace, **tiny: Any) -> bool:
    """With ``--smoke``: set each of ``tiny`` on ``args`` and point ``args.out`` at a
    new temporary directory. Returns whether this is a smoke run."""
    global _active
    if not args.smoke:
        return False
    _active = True
    for name, value in tiny.items():
        if not hasattr(args, name):
            raise AttributeError(f"smoke: the parser has no --{name.replace('_', '-')}")
        setattr(args, name, value)
    args.out = tempfile.mkdtemp(prefix="objckpt-bench-smoke-")
    logging.getLogger("bench").info("smoke run: %s; results go to %s", tiny, args.out)
    return True


def installed(module: str, what: str, hint: str = "pip install 'objckpt[bench]'") -> bool:
    """Whether the optional peer ``module`` can be imported; logs a skip line if not."""
    if importlib.util.find_spec(module) is not None:
        return True
    log.warning("skipping %s: %s is not installed (%s)", what, module, hint)
    return False


def count(real: int, tiny: int) -> int:
    """``tiny`` in a smoke run, else ``real``: for shapes a script's options do not set
    (how many small tensors a state dict has, say)."""
    return tiny if _active else real
