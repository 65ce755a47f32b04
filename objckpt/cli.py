"""The ``objckpt`` command line (click).

Only ``demo`` exists so far; ``ls``, ``info``, ``verify``, ``gc``, ``rm`` and ``cp``
arrive with the CheckpointManager work. Endpoint and credentials come from the
standard environment and from repeatable ``--storage-option KEY=VALUE``.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click

from objckpt.errors import ObjckptError

__all__ = ["main"]


def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"expected KEY=VALUE, got {pair!r}", param_hint="--storage-option"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """objckpt: PyTorch distributed checkpoints on object stores."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--steps", default=300, show_default=True, help="Training steps.")
@click.option("--every", default=50, show_default=True, help="Checkpoint every N steps.")
@click.option("--width", default=256, show_default=True, help="Hidden width of the demo MLP.")
@click.option(
    "--url", default=None, help="Checkpoint root URL (default: an embedded moto S3 server)."
)
@click.option(
    "--storage-option",
    "storage_option",
    multiple=True,
    help="fsspec option KEY=VALUE (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(
    steps: int,
    every: int,
    width: int,
    url: str | None,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Train a small model, checkpoint it, restart from the latest checkpoint, verify."""
    from objckpt.demo import run_demo

    if every < 1 or steps < every:
        raise click.BadParameter("need --steps >= --every >= 1", param_hint="--every")
    try:
        result = run_demo(
            steps=steps,
            every=every,
            width=width,
            url=url,
            storage_options=_parse_options(storage_option) or None,
        )
    except ObjckptError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "url": result.url,
                    "saves": [
                        {"step": s.step, "bytes": s.bytes, "save_seconds": s.save_seconds}
                        for s in result.saves
                    ],
                    "restored_step": result.restored_step,
                    "load_seconds": result.load_seconds,
                    "weights_match": result.weights_match,
                }
            )
        )
    else:
        click.echo(f"checkpoints under {result.url}")
        click.echo(f"{'step':>6} {'bytes':>12} {'save s':>8}")
        for s in result.saves:
            click.echo(f"{s.step:>6} {s.bytes:>12,} {s.save_seconds:>8.3f}")
        click.echo(
            f"restored step {result.restored_step} in {result.load_seconds:.3f} s; "
            f"weights match: {'yes' if result.weights_match else 'NO'}"
        )
    if not result.weights_match:
        sys.exit(2)
