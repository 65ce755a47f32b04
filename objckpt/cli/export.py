"""The CLI's conversions: ``export`` and ``import`` between DCP checkpoints and
safetensors, and ``stock-metadata`` for stock DCP readers.

``export`` writes a committed checkpoint as Hugging Face safetensors shards (index
last); ``import`` turns such a directory into a DCP checkpoint. Both pass each
side's storage options on, so source and destination may live on different stores.
``stock-metadata`` writes the ``.metadata`` a save above
``UploadOptions.stock_metadata_max_ranks`` left out.
"""

from __future__ import annotations

import contextlib
from typing import Any

import click

from objckpt.cli.common import CommandContext, store_command

__all__ = ["export_command", "import_command", "stock_metadata_command"]


@click.command("export")
@click.argument("step_url")
@click.argument("dest_url")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors"]),
    default="safetensors",
    show_default=True,
    help="What to write (Hugging Face safetensors shards and their index).",
)
@click.option("--dtype", default=None, help="Convert floating-point tensors (bf16, fp16, fp32).")
@click.option("--keys", multiple=True, help="Glob of tensor names to export (repeatable).")
@click.option("--shard-size", default="5GB", show_default=True, help="Most bytes per shard.")
@store_command
def export_command(
    ctx: CommandContext,
    step_url: str,
    dest_url: str,
    fmt: str,
    dtype: str | None,
    keys: tuple[str, ...],
    shard_size: str,
) -> None:
    """Export the committed checkpoint STEP_URL to DEST_URL (index written last)."""
    from objckpt.ops.convert.export import export_safetensors

    source = ctx.storage_options(step_url, "STEP_URL")
    dest = ctx.storage_options(dest_url, "DEST_URL")
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []  # the drawn bar (None with --json), once the total is known

        def progress(n: int, total: int) -> None:
            if not bar:
                bar.append(stack.enter_context(ctx.progress_bar(total, "exporting")))
            if bar[0] is not None:
                bar[0].update(n)

        report = export_safetensors(
            step_url,
            dest_url,
            storage_options=source,
            dest_storage_options=dest,
            dtype=dtype,
            keys=list(keys) or None,
            shard_size=shard_size,
            retry=ctx.retry,
            progress=progress,
        )
    ctx.emit(
        {
            "dest": report.dest,
            "format": fmt,
            "tensors": report.tensors,
            "total_size": report.total_size,
            "files": [{"name": n, "size": s, "crc32c": c} for n, s, c in report.files],
        },
        lambda: click.echo(
            f"exported {report.tensors} tensors ({report.total_size:,} bytes) to {report.dest} "
            f"in {len(report.files)} shard(s)"
        ),
    )


@click.command("import")
@click.argument("src_url")
@click.argument("step_url")
@click.option("--keys", multiple=True, help="Glob of tensor names to import (repeatable).")
@store_command
def import_command(ctx: CommandContext, src_url: str, step_url: str, keys: tuple[str, ...]) -> None:
    """Import the safetensors checkpoint SRC_URL as a DCP checkpoint at STEP_URL."""
    from objckpt.ops.convert.export import import_safetensors

    count = import_safetensors(
        src_url,
        step_url,
        storage_options=ctx.storage_options(src_url, "SRC_URL"),
        dest_storage_options=ctx.storage_options(step_url, "STEP_URL"),
        keys=list(keys) or None,
        retry=ctx.retry,
    )
    ctx.emit(
        {"src": src_url, "dest": step_url, "tensors": count},
        lambda: click.echo(f"imported {count} tensors from {src_url} into {step_url}"),
    )


@click.command("stock-metadata")
@click.argument("step_url")
@store_command
def stock_metadata_command(ctx: CommandContext, step_url: str) -> None:
    """Write .metadata for the committed step STEP_URL, so stock DCP readers
    (FileSystemReader, FsspecReader) load it: for a save above
    UploadOptions.stock_metadata_max_ranks, which wrote none. Nothing is written
    where the step has its own already. Memory and time grow with the step's items
    (every rank's index object is read)."""
    from objckpt.ops.convert.stock import write_stock_metadata

    loc = ctx.location(step_url, "STEP_URL")
    entry = write_stock_metadata(loc)
    ctx.emit(
        {"url": loc.url_of(entry.key), "size": entry.size, "crc32c": entry.crc32c},
        lambda: click.echo(f"{loc.url_of(entry.key)}: {entry.size:,} bytes"),
    )
