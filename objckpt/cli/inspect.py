"""The CLI's read-only views of a store: ``ls`` (the steps under a root) and ``info``.

``ls`` answers "what is there and how far behind is everything else": each step's
state, size and time under the root, with a config naming backups how far each
backup trails, and with ``--local`` which steps this node's local tier holds.
``info`` summarises one committed checkpoint from its manifest, without loading it,
including how many of its bytes it stores itself and how many it reuses from earlier
steps (references, :mod:`objckpt.format.refs`). It decodes the manifest's metadata
and every index object as a load does (:func:`objckpt.ops.maintain.verify.require_loadable`),
and refuses, naming the object and the bound, a checkpoint a load would refuse: a
summary of one that cannot load would be read as a promise that it can.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING, Any

import click

from objckpt.cli.common import CommandContext, committed_manifest, store_command
from objckpt.errors import ObjckptError
from objckpt.writers.location import Location

if TYPE_CHECKING:
    from objckpt.format.steps import StepInfo

__all__ = ["info_command", "ls_command"]


def _when(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


@click.command("ls")
@click.argument("root", required=False)
@click.option(
    "--local",
    "local",
    default=None,
    metavar="PATH",
    help="Also list this node's local tier (LocalTier path): which steps are where, "
    "and how far the root trails it.",
)
@store_command
def ls_command(ctx: CommandContext, root: str | None, local: str | None) -> None:
    """List the steps under ROOT: committed or not, objects, bytes, time; with a
    config naming backups, how far each backup trails; with --local, which steps
    this node's local tier holds."""
    from objckpt.format.steps import steps_of
    from objckpt.writers import open_store

    loc = ctx.location(root, "ROOT")
    store = open_store(loc)
    try:
        steps = steps_of(store.inventory(), loc)
    finally:
        store.close()
    local_steps: dict[int, StepInfo] = {}
    if local is not None:
        local_loc = Location.parse(local)
        if not local_loc.is_local:
            raise click.BadParameter(f"{local} is not a local directory", param_hint="--local")
        local_steps = {s.step: s for s in steps_of(open_store(local_loc).inventory(), local_loc)}
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


def _backup_lag(ctx: CommandContext, loc: Location, steps: list[StepInfo]) -> list[dict[str, Any]]:
    """Lag of the config's backups when ``loc`` is the config's root."""
    from objckpt.ops.run.backup import committed_steps, lag_of

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


@click.command("info")
@click.argument("ckpt")
@click.option("--tensors/--no-tensors", default=True, help="List every tensor (default on).")
@store_command
def info_command(ctx: CommandContext, ckpt: str, tensors: bool) -> None:
    """Summarise the committed checkpoint CKPT (manifest and tensors); refuse one
    a load would refuse (its metadata and index objects are decoded as a load does)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from objckpt.format.refs import referenced_step
    from objckpt.ops.maintain.verify import require_loadable
    from objckpt.writers import open_store

    loc = ctx.location(ckpt, "CKPT")
    m = committed_manifest(loc)
    reused = sum(o.size for o in m.objects if referenced_step(o.key) is not None)
    reused_from = sorted({s for o in m.objects if (s := referenced_step(o.key)) is not None})
    store = open_store(loc)
    try:
        metadata = require_loadable(store, m)
    finally:
        store.close()
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
        "stored_bytes": m.total_bytes - reused,
        "reused_bytes": reused,
        "reused_from": reused_from,
        "user": dict(m.user),
        "requests": None if m.requests is None else m.requests.to_json(),
        "entries": entries if tensors else len(entries),
    }

    def human() -> None:
        click.echo(f"{loc.url}")
        click.echo(f"  committed  {m.created} (attempt {m.attempt})")
        click.echo(f"  world size {m.world_size}")
        click.echo(f"  objects    {len(m.objects)} ({m.total_bytes:,} bytes)")
        if reused:
            click.echo(
                f"  stored     {m.total_bytes - reused:,} bytes here, {reused:,} reused from "
                f"{', '.join(reused_from)}"
            )
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
