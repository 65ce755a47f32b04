"""The CLI's ``demo``: train, checkpoint, restart and verify, end to end.

Unlike the store commands it takes no config; its errors get the store commands'
exit codes (2 for a bad ``--url`` or ``--storage-option``, 3 for a missing bucket,
4 for any other failure), and 5 means the restored weights did not match the saved
ones.
"""

from __future__ import annotations

import json
import sys

import click

from objckpt.cli.common import check_option_names, errors_to_exit_codes, parse_options, parse_url

__all__ = ["EXIT_MISMATCH", "demo"]

#: The demo's own exit code: the restored weights differ from the saved ones.
EXIT_MISMATCH = 5


@click.command()
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
    options = parse_options(storage_option)
    if url is not None:
        check_option_names(parse_url(url, "--url"), options)
    with errors_to_exit_codes():
        result = run_demo(
            steps=steps,
            every=every,
            width=width,
            url=url,
            storage_options=options or None,
        )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "url": result.url,
                    "saves": [
                        {"step": s.step, "bytes": s.bytes, "save_seconds": s.save_seconds}
                        for s in result.saves
                    ],
                    "kept_steps": list(result.kept_steps),
                    "restored_step": result.restored_step,
                    "load_seconds": result.load_seconds,
                    "weights_match": result.weights_match,
                }
            )
        )
    else:
        click.echo(f"checkpoints under {result.url}")
        click.echo(f"{'step':>6} {'bytes':>12} {'stall s':>8}")
        for s in result.saves:
            click.echo(f"{s.step:>6} {s.bytes:>12,} {s.save_seconds:>8.3f}")
        click.echo(f"kept steps (keep_last=3): {', '.join(map(str, result.kept_steps))}")
        click.echo(
            f"restored step {result.restored_step} in {result.load_seconds:.3f} s; "
            f"weights match: {'yes' if result.weights_match else 'NO'}"
        )
    if not result.weights_match:
        sys.exit(EXIT_MISMATCH)
