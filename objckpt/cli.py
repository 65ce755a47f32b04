"""The ``objckpt`` command line (click).

Commands: ``ls``, ``info``, ``verify``, ``gc``, ``rm``, ``cp``, ``demo``. Endpoint
and credentials come from the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``STORAGE_EMULATOR_HOST``, ...), from a
config file (``--config`` or ``OBJCKPT_CONFIG``) and from repeatable
``--storage-option KEY=VALUE`` (which wins). ``--json`` prints one JSON document
on stdout for scripts; logs and progress go to stderr.

Exit codes: 0 success; 1 a check failed (``verify`` found a bad object); 2 usage
error; 3 no such checkpoint, or not committed; 4 any other objckpt error
(store unreachable, access denied, invalid manifest or config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from objckpt.errors import CheckpointNotFoundError, ObjckptError
from objckpt.writers.location import Location

if TYPE_CHECKING:
    from objckpt.format.steps import StepInfo

__all__ = ["main"]

EXIT_CHECK_FAILED = 1
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4


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


@dataclasses.dataclass(frozen=True)
class _Context:
    """What the group's options give every command."""

    config_path: str | None
    options: dict[str, Any]
    as_json: bool

    @functools.cached_property
    def config(self) -> Any:
        from objckpt.ops.config import load_config

        return load_config(self.config_path) if self.config_path else None

    def storage_options(self, url: str) -> dict[str, Any]:
        """Options for ``url``: the config's, then --storage-option; none for local paths."""

        if Location.parse(url).is_local:
            return {}
        merged = dict(self.config.storage_options) if self.config else {}
        merged.update(self.options)
        return merged

    def location(self, url: str | None, what: str) -> Any:

        if url is None:
            if self.config is None:
                raise click.UsageError(f"give {what} or a config file (--config) naming the root")
            url = self.config.root
        return Location.parse(url, self.storage_options(url))

    def emit(self, doc: Any, human: Callable[[], None]) -> None:
        if self.as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        else:
            human()


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """objckpt errors become one line on stderr and a documented exit code."""
    try:
        yield
    except CheckpointNotFoundError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_NOT_FOUND)
    except ObjckptError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ERROR)


def _command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Common options of every store command: --storage-option and --json."""

    @click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec option (repeatable; JSON values allowed).",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
    @click.pass_obj
    @functools.wraps(fn)
    def wrapper(
        obj: dict[str, Any], storage_option: tuple[str, ...], as_json: bool, **kw: Any
    ) -> Any:
        ctx = _Context(obj.get("config"), _parse_options(storage_option), as_json)
        with _errors():
            return fn(ctx, **kw)

    return wrapper


def _progress(total: int, label: str, quiet: bool) -> Any:
    """A progress bar on stderr (drawn only on a terminal, never with --json)."""
    if quiet:
        return contextlib.nullcontext(None)
    return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=False)


def _committed_manifest(loc: Any) -> Any:
    """The committed manifest at ``loc`` (read once; the command passes it on)."""
    from objckpt.ops.verify import open_manifest
    from objckpt.writers import open_store

    store = open_store(loc)
    try:
        return open_manifest(store)
    finally:
        store.close()


def _when(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option(
    "--config",
    "config",
    envvar="OBJCKPT_CONFIG",
    type=click.Path(dir_okay=False),
    help="TOML config file (root, storage, retention); env OBJCKPT_CONFIG.",
)
@click.pass_context
def main(ctx: click.Context, verbose: int, config: str | None) -> None:
    """objckpt: PyTorch distributed checkpoints on object stores."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = {"config": config}


@main.command("ls")
@click.argument("root", required=False)
@click.option(
    "--local",
    "local",
    default=None,
    metavar="PATH",
    help="Also list this node's local tier (LocalTier path): which steps are where, "
    "and how far the root trails it.",
)
@_command
def ls_command(ctx: _Context, root: str | None, local: str | None) -> None:
    """List the steps under ROOT: committed or not, objects, bytes, time; with a
    config naming backups, how far each backup trails; with --local, which steps
    this node's local tier holds."""
    from objckpt.format.steps import inventory, steps_of
    from objckpt.writers import open_store

    loc = ctx.location(root, "ROOT")
    store = open_store(loc)
    try:
        steps = steps_of(inventory(store.fs, loc), loc)
    finally:
        store.close()
    local_steps: dict[int, StepInfo] = {}
    if local is not None:
        local_loc = Location.parse(local)
        if not local_loc.is_local:
            raise click.BadParameter(f"{local} is not a local directory", param_hint="--local")
        local_steps = {
            s.step: s for s in steps_of(inventory(local_loc.open_fs(), local_loc), local_loc)
        }
    doc: list[dict[str, Any]] = [
        {
            "step": s.step,
            "url": s.url,
            "committed": s.committed,
            "objects": s.objects,
            "bytes": s.bytes,
            "modified": _when(s.modified),
        }
        | ({"local": s.step in local_steps and local_steps[s.step].committed} if local else {})
        for s in steps
    ]
    on_root = {s.step for s in steps}
    doc += [
        {
            "step": s.step,
            "url": s.url,
            "committed": False,
            "objects": 0,
            "bytes": 0,
            "modified": None,
            "local": True,
        }
        for s in local_steps.values()
        if s.committed and s.step not in on_root
    ]
    doc.sort(key=lambda d: d["step"])
    backups = _backup_lag(ctx, loc, steps)
    tier = _tier_lag(local, steps, local_steps) if local else None

    def human() -> None:
        if not doc:
            click.echo(f"no steps under {loc.url}")
        else:
            where = f" {'local':<5}" if local else ""
            click.echo(f"{'step':>12}  {'state':<11}{where} {'objects':>7} {'bytes':>15}  modified")
        for d in doc:
            state = "committed" if d["committed"] else "incomplete"
            if d.get("local") and not d["objects"]:
                state = "local only"
            where = f" {'yes' if d.get('local') else '-':<5}" if local else ""
            click.echo(
                f"{d['step']:>12}  {state:<11}{where} {d['objects']:>7} {d['bytes']:>15,}  "
                f"{d['modified'] or '-'}"
            )
        for b in backups:
            latest = "none" if b["latest_step"] is None else f"step {b['latest_step']}"
            line = (
                f"backup {b['url']} ({b['mode']}): latest {latest}, "
                f"{b['steps_behind']} step(s) / {b['seconds_behind']:.0f} s behind"
            )
            click.echo(line + (f" [{b['error']}]" if b["error"] else ""))
        if tier is not None:
            click.echo(
                f"local tier {tier['path']}: latest {tier['local_latest']}, root latest "
                f"{tier['durable_latest']}; {tier['steps_not_durable']} local step(s) newer "
                f"than the root's ({tier['seconds_behind']:.0f} s)"
            )

    out: dict[str, Any] = {"root": loc.url, "steps": doc, "backups": backups}
    if tier is not None:
        out["local_tier"] = tier
    ctx.emit(out, human)


def _tier_lag(path: str, steps: list[StepInfo], local: dict[int, StepInfo]) -> dict[str, Any]:
    """How far the root trails the local tier: local steps newer than its newest."""
    durable = max((s.step for s in steps if s.committed), default=None)
    held = [s for s in local.values() if s.committed]
    ahead = [s for s in held if durable is None or s.step > durable]
    times = [s.modified for s in ahead if s.modified is not None]
    return {
        "path": Location.parse(path).url,
        "local_latest": max((s.step for s in held), default=None),
        "durable_latest": durable,
        "steps_not_durable": len(ahead),
        "seconds_behind": round(max(0.0, time.time() - min(times)), 1) if times else 0.0,
    }


def _backup_lag(ctx: _Context, loc: Location, steps: list[StepInfo]) -> list[dict[str, Any]]:
    """Lag of the config's backups when ``loc`` is the config's root."""
    from objckpt.ops.backup import committed_steps, lag_of

    config = ctx.config
    if config is None or not config.backups or Location.parse(config.root).url != loc.url:
        return []
    out = []
    for target in config.backups:
        error = None
        try:
            held = [s.step for s in committed_steps(target.location)]
        except ObjckptError as exc:
            held, error = [], str(exc)
        behind, seconds = lag_of(steps, held, time.time())
        out.append(
            {
                "url": target.location.url,
                "mode": target.mode,
                "latest_step": max(held) if held else None,
                "steps_behind": behind,
                "seconds_behind": round(seconds, 1),
                "error": error,
            }
        )
    return out


@main.command("info")
@click.argument("ckpt")
@click.option("--tensors/--no-tensors", default=True, help="List every tensor (default on).")
@_command
def info_command(ctx: _Context, ckpt: str, tensors: bool) -> None:
    """Summarise the committed checkpoint CKPT (manifest and tensors)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from objckpt.format.index import dcp_metadata

    loc = ctx.location(ckpt, "CKPT")
    m = _committed_manifest(loc)
    metadata = dcp_metadata(m, url=loc.url)
    entries: list[dict[str, Any]] = []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            entries.append({"name": fqn, "shape": list(md.size), "dtype": dtype})
        else:
            entries.append({"name": fqn, "shape": None, "dtype": "bytes"})
    doc = {
        "url": loc.url,
        "attempt": m.attempt,
        "created": m.created,
        "world_size": m.world_size,
        "objckpt_version": m.objckpt_version,
        "torch_version": m.torch_version,
        "objects": len(m.objects),
        "bytes": m.total_bytes,
        "user": dict(m.user),
        "requests": None if m.requests is None else m.requests.to_json(),
        "entries": entries if tensors else len(entries),
    }

    def human() -> None:
        click.echo(f"{loc.url}")
        click.echo(f"  committed  {m.created} (attempt {m.attempt})")
        click.echo(f"  world size {m.world_size}")
        click.echo(f"  objects    {len(m.objects)} ({m.total_bytes:,} bytes)")
        click.echo(f"  written by objckpt {m.objckpt_version}, torch {m.torch_version}")
        if m.requests is not None:
            click.echo(f"  save cost  {m.requests.summary()}")
        if m.user:
            click.echo(f"  user       {json.dumps(dict(m.user))}")
        click.echo(f"  entries    {len(entries)}")
        if tensors:
            for e in entries:
                shape = "x".join(map(str, e["shape"])) if e["shape"] is not None else "-"
                click.echo(f"    {e['name']:<48} {e['dtype']:<10} {shape}")

    ctx.emit(doc, human)


@main.command("verify")
@click.argument("ckpt")
@_command
def verify_command(ctx: _Context, ckpt: str) -> None:
    """Check every object of CKPT against the manifest's size and CRC32C.

    Exits 1 and names each object that fails; never loads anything into torch.
    """
    from objckpt.ops.verify import verify_checkpoint

    loc = ctx.location(ckpt, "CKPT")
    manifest = _committed_manifest(loc)
    with _progress(manifest.total_bytes, "verifying", ctx.as_json) as bar:
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
            click.echo(f"FAIL {loc.url_of(f.key)}: {f.problem}")
        verdict = "ok" if report.ok else f"{len(report.failures)} of {len(report.objects)} failed"
        click.echo(f"{loc.url}: {len(report.objects)} objects checked, {verdict}")

    ctx.emit(doc, human)
    if not report.ok:
        sys.exit(EXIT_CHECK_FAILED)


@main.command("gc")
@click.argument("root", required=False)
@click.option("--apply", is_flag=True, help="Delete (default: only print what would go).")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    help="Spare objects younger than this many seconds (default 3600, or the config's).",
)
@_command
def gc_command(ctx: _Context, root: str | None, apply: bool, grace: float | None) -> None:
    """Remove what no committed manifest names under ROOT, and stale multipart uploads."""
    from objckpt.ops.gc import DEFAULT_GRACE, collect_garbage

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


@main.command("rm")
@click.argument("ckpt")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_command
def rm_command(ctx: _Context, ckpt: str, yes: bool) -> None:
    """Delete the checkpoint CKPT (its manifest first, so it vanishes at once)."""
    from objckpt.ops.gc import delete_step

    loc = ctx.location(ckpt, "CKPT")
    if not yes and not ctx.as_json:
        click.confirm(f"delete {loc.url}?", abort=True, err=True)
    removed = delete_step(loc)
    ctx.emit(
        {"url": loc.url, "deleted_objects": removed},
        lambda: click.echo(f"deleted {loc.url} ({removed} objects)"),
    )


@main.command("cp")
@click.argument("src")
@click.argument("dst")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at DST.")
@_command
def cp_command(ctx: _Context, src: str, dst: str, overwrite: bool) -> None:
    """Copy the committed checkpoint SRC to DST, checking CRC32C, manifest last."""
    from objckpt.ops.verify import copy_checkpoint

    src_loc = ctx.location(src, "SRC")
    dst_loc = ctx.location(dst, "DST")
    source = _committed_manifest(src_loc)
    with _progress(source.total_bytes, "copying", ctx.as_json) as bar:
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


@main.command("export")
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
@_command
def export_command(
    ctx: _Context,
    step_url: str,
    dest_url: str,
    fmt: str,
    dtype: str | None,
    keys: tuple[str, ...],
    shard_size: str,
) -> None:
    """Export the committed checkpoint STEP_URL to DEST_URL (index written last)."""
    from objckpt.ops.export import export_safetensors

    bar: Any = None

    def progress(n: int, total: int) -> None:
        nonlocal bar
        if ctx.as_json:
            return
        if bar is None:
            bar = click.progressbar(length=total, label="exporting", file=sys.stderr)
            bar.__enter__()
        bar.update(n)

    try:
        report = export_safetensors(
            step_url,
            dest_url,
            storage_options=ctx.storage_options(step_url),
            dest_storage_options=ctx.storage_options(dest_url),
            dtype=dtype,
            keys=list(keys) or None,
            shard_size=shard_size,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
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


@main.command("import")
@click.argument("src_url")
@click.argument("step_url")
@click.option("--keys", multiple=True, help="Glob of tensor names to import (repeatable).")
@_command
def import_command(ctx: _Context, src_url: str, step_url: str, keys: tuple[str, ...]) -> None:
    """Import the safetensors checkpoint SRC_URL as a DCP checkpoint at STEP_URL."""
    from objckpt.ops.export import import_safetensors

    count = import_safetensors(
        src_url,
        step_url,
        storage_options=ctx.storage_options(src_url),
        dest_storage_options=ctx.storage_options(step_url),
        keys=list(keys) or None,
    )
    ctx.emit(
        {"src": src_url, "dest": step_url, "tensors": count},
        lambda: click.echo(f"imported {count} tensors from {src_url} into {step_url}"),
    )


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
        sys.exit(2)
