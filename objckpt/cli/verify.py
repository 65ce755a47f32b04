"""The CLI's ``verify``: check a checkpoint's objects against its manifest.

Its own module because it is the one check whose failure is an answer, not an
error: a bad object, or metadata a load refuses, exits 1 (``EXIT_CHECK_FAILED``)
after naming each failure.
"""

from __future__ import annotations

import sys

import click

from objckpt.cli.common import (
    EXIT_CHECK_FAILED,
    CommandContext,
    committed_manifest,
    store_command,
)

__all__ = ["verify_command"]


@click.command("verify")
@click.argument("ckpt")
@store_command
def verify_command(ctx: CommandContext, ckpt: str) -> None:
    """Check every object of CKPT against the manifest's size and CRC32C, and
    decode the manifest's metadata and every index object with the bounds a load
    applies.

    Objects CKPT reuses from an earlier step are checked where they are stored.
    Exits 1 and names each object that fails (both steps for a reused one) or that a
    load would refuse (and the bound it breaks); never loads anything into torch.
    """
    from objckpt.ops.maintain.verify import verify_checkpoint

    loc = ctx.location(ckpt, "CKPT")
    manifest = committed_manifest(loc)
    with ctx.progress_bar(manifest.total_bytes, "verifying") as bar:
        report = verify_checkpoint(
            loc, manifest=manifest, progress=bar.update if bar is not None else None
        )
    doc = {
        "url": loc.url,
        "ok": report.ok,
        "objects": len(report.objects),
        "bytes": report.manifest.total_bytes,
        "failures": [
            {
                "key": f.key,
                "url": f.stored_at or loc.url_of(f.key),
                "problem": f.problem,
                "size": f.size,
                "actual_size": f.actual_size,
                "crc32c": f.crc32c,
                "actual_crc32c": f.actual_crc32c,
            }
            for f in report.failures
        ],
    }

    def human() -> None:
        for f in report.failures:
            click.echo(f"FAIL {f.stored_at or loc.url_of(f.key)}: {f.problem}")
        bad = len(report.failures) - len(report.refused)
        verdicts = [f"{bad} of {len(report.objects)} failed"] if bad else []
        if report.refused:
            verdicts.append(f"{len(report.refused)} refused by a load's checks")
        verdict = ", ".join(verdicts) or "ok"
        click.echo(f"{loc.url}: {len(report.objects)} objects checked, {verdict}")

    ctx.emit(doc, human)
    if not report.ok:
        sys.exit(EXIT_CHECK_FAILED)
