"""The ``objckpt`` click group: global options, logging, and the commands it holds.

The group reads ``-v`` and ``--config`` once and hands the config path to every
command through click's context object; each command lives in the module of its
group (:mod:`objckpt.cli.inspect`, :mod:`objckpt.cli.verify`,
:mod:`objckpt.cli.maintain`, :mod:`objckpt.cli.export`, :mod:`objckpt.cli.demo`)
and is attached here, so those modules never import the group.
"""

from __future__ import annotations

import logging

import click

from objckpt.cli.demo import demo
from objckpt.cli.export import export_command, import_command
from objckpt.cli.inspect import info_command, ls_command
from objckpt.cli.maintain import cp_command, gc_command, rm_command
from objckpt.cli.verify import verify_command

__all__ = ["main"]


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


main.add_command(ls_command)
main.add_command(info_command)
main.add_command(verify_command)
main.add_command(gc_command)
main.add_command(rm_command)
main.add_command(cp_command)
main.add_command(export_command)
main.add_command(import_command)
main.add_command(demo)
