"""The CLI's commands that change a store: ``gc``, ``rm`` and ``cp``.

``gc`` removes what no committed manifest names (a dry run unless ``--apply``),
``rm`` deletes one checkpoint manifest first, ``cp`` copies a committed checkpoint
with CRC32C checks and its manifest last, so a reader never sees half of one.

Steps may reference each other's bytes (reuse, :mod:`objckpt.format.refs`): ``gc``
and ``rm`` decide over the root's live set (:mod:`objckpt.ops.maintain.live_set`), so what a
committed step references is never removed, and ``cp`` copies a referencing step
whole into a step directory (:func:`objckpt.ops.maintain.verify.copy_checkpoint`).
"""

from __future__ import annotations

import dataclasses

import click

from objckpt.cli.common import CommandContext, committed_manifest, store_command

__all__ = ["cp_command", "gc_command", "rm_command"]


@click.command("gc")
@click.argument("root", required=False)
@click.option("--apply", is_flag=True, help="Delete (default: only print what would go).")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    help="Spare objects younger than this many seconds (default 3600, or the config's).",
)
@store_command
def gc_command(ctx: CommandContext, root: str | None, apply: bool, grace: float | None) -> None:
    """Remove what no committed manifest names under ROOT (references included) and
    no young uncommitted index references, and stale multipart uploads."""
    from objckpt.ops.maintain.gc import DEFAULT_GRACE, collect_garbage

    loc = ctx.location(root, "ROOT")
    if grace is None:
        grace = ctx.config.gc_grace if ctx.config else DEFAULT_GRACE
    report = collect_garbage(loc, grace=grace, dry_run=not apply)
    doc = dataclasses.asdict(report)

    def human() -> None:
        verb = "removed" if apply else "would remove"
        for key in report.deleted:
            click.echo(f"{verb} {loc.url_of(key)}")
        for key in report.aborted_uploads:
            click.echo(f"{'aborted' if apply else 'would abort'} upload {loc.url_of(key)}")
        click.echo(
            f"{verb} {len(report.deleted)} objects ({report.bytes_reclaimed:,} bytes) and "
            f"{len(report.aborted_uploads)} open uploads; spared {len(report.spared)} younger "
            f"than {grace:g} s"
        )
        if not apply and (report.deleted or report.aborted_uploads):
            click.echo("dry run: pass --apply to delete")

    ctx.emit(doc, human)


@click.command("rm")
@click.argument("ckpt")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@store_command
def rm_command(ctx: CommandContext, ckpt: str, yes: bool) -> None:
    """Delete the checkpoint CKPT (its manifest first, so it vanishes at once); objects
    of it that later steps reference stay."""
    from objckpt.ops.maintain.gc import delete_step

    loc = ctx.location(ckpt, "CKPT")
    if not yes and not ctx.as_json:
        ctx.confirm(f"delete {loc.url}?")
    removed = delete_step(loc)
    ctx.emit(
        {"url": loc.url, "deleted_objects": removed},
        lambda: click.echo(f"deleted {loc.url} ({removed} objects)"),
    )


@click.command("cp")
@click.argument("src")
@click.argument("dst")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at DST.")
@store_command
def cp_command(ctx: CommandContext, src: str, dst: str, overwrite: bool) -> None:
    """Copy the committed checkpoint SRC to DST, checking CRC32C, manifest last.

    A step that reuses earlier steps' bytes is copied whole into a step directory
    (DST = <root>/step-N): the objects it references go beside it.
    """
    from objckpt.ops.maintain.verify import copy_checkpoint

    src_loc = ctx.location(src, "SRC")
    dst_loc = ctx.location(dst, "DST")
    source = committed_manifest(src_loc)
    with ctx.progress_bar(source.total_bytes, "copying") as bar:
        report = copy_checkpoint(
            src_loc,
            dst_loc,
            manifest=source,
            overwrite=overwrite,
            progress=bar.update if bar is not None else None,
        )
    manifest = report.manifest
    if not report.copied:
        summary = f"{dst_loc.url} already holds this checkpoint; nothing copied"
    else:
        summary = (
            f"copied {src_loc.url} -> {dst_loc.url} ({len(manifest.objects)} objects, "
            f"{manifest.total_bytes:,} bytes; {report.server_side} copied server-side)"
        )
    ctx.emit(
        {
            "src": src_loc.url,
            "dst": dst_loc.url,
            "copied": report.copied,
            "objects": len(manifest.objects),
            "bytes": manifest.total_bytes,
            "server_side": report.server_side,
            "streamed": report.streamed,
        },
        lambda: click.echo(summary),
    )
