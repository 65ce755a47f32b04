"""What every store command of the CLI shares: options, context, exit codes, output.

A store command gets ``--storage-option`` and ``--json`` from :func:`store_command`,
resolves its URLs through one :class:`CommandContext` (config file first, then
``--storage-option``), prints through :meth:`CommandContext.emit` (one JSON document
with ``--json``, lines for people otherwise) and turns objckpt errors into the
documented exit codes. Keeping this in one place is what keeps the commands' flags,
messages and exit codes alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from objckpt.errors import BucketNotFoundError, CheckpointNotFoundError, ObjckptError
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy
from objckpt.writers.translate import describe

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "CommandContext",
    "committed_manifest",
    "errors_to_exit_codes",
    "exit_code",
    "one_line",
    "parse_options",
    "progress_bar",
    "store_command",
]

logger = logging.getLogger(__name__)

EXIT_CHECK_FAILED = 1
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4


def parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` pairs as a dict, each value JSON if it parses.

    Args:
        pairs: The ``--storage-option`` values as given.

    Returns:
        The options by key; a value that is not JSON stays a string.

    Raises:
        click.BadParameter: A pair has no ``=`` or no key.
    """
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
class CommandContext:
    """What the group's options give every command."""

    config_path: str | None
    options: dict[str, Any]
    as_json: bool
    #: ``--deadline``: overrides the config's ``[retry] request_deadline``.
    request_deadline: float | None = None

    @functools.cached_property
    def config(self) -> Any:
        """The loaded config file (read on first use), or None without ``--config``."""
        from objckpt.ops.config import load_config

        return load_config(self.config_path) if self.config_path else None

    @functools.cached_property
    def retry(self) -> RetryPolicy:
        """How the command's requests are retried: the config's ``[retry]`` table,
        then ``--deadline`` (each request with its retries, so a silent endpoint
        fails the command in that time)."""
        policy = self.config.retry if self.config else RetryPolicy()
        if self.request_deadline is not None:
            policy = dataclasses.replace(policy, request_deadline=self.request_deadline)
        return policy

    def storage_options(self, url: str) -> dict[str, Any]:
        """Options for ``url``: the config's, then --storage-option; none for local paths."""

        if Location.parse(url).is_local:
            return {}
        merged = dict(self.config.storage_options) if self.config else {}
        merged.update(self.options)
        return merged

    def location(self, url: str | None, what: str) -> Any:
        """The :class:`Location` of ``url``, or of the config's root when ``url`` is None.

        Raises:
            click.UsageError: No ``url`` and no config naming a root (``what`` names
                the missing argument).
        """
        if url is None:
            if self.config is None:
                raise click.UsageError(f"give {what} or a config file (--config) naming the root")
            url = self.config.root
        return Location.parse(url, self.storage_options(url), self.retry)

    def emit(self, doc: Any, human: Callable[[], None]) -> None:
        """Print ``doc`` as JSON with ``--json``, else call ``human`` to print lines."""
        if self.as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        else:
            human()


def exit_code(exc: BaseException) -> int:
    """The documented exit code for an error a command met: 3 for a checkpoint or
    bucket that is not there, 4 for anything else."""
    if isinstance(exc, (CheckpointNotFoundError, BucketNotFoundError)):
        return EXIT_NOT_FOUND
    return EXIT_ERROR


def _torch_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's ``CheckpointException`` (a ``BaseException``).

    Looked up in ``sys.modules`` rather than imported: an exception of that class
    exists only once its module was loaded, so a command that never loaded it cannot
    have met one. (It saves no import: ``ls``, ``gc`` and the other store commands
    reach torch through :mod:`objckpt.format`, which needs DCP's metadata classes.)
    """
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(exc, api.CheckpointException)


def _unwrap(exc: BaseException) -> BaseException:
    """The objckpt error torch's ``CheckpointException`` carries, else ``exc``."""
    if not _torch_error(exc):
        return exc
    from objckpt.ops.torch_errors import unwrap as seen_through

    return seen_through(exc)


def one_line(exc: BaseException) -> str:
    """What the CLI prints for ``exc``: objckpt's own message, or for anything else
    its type and a credential-free summary (torch's ``CheckpointException`` is seen
    through to the error a rank raised)."""
    inner = _unwrap(exc)
    if isinstance(inner, ObjckptError):
        return str(inner).splitlines()[0] if str(inner) else type(inner).__name__
    return describe(inner).splitlines()[0]


@contextlib.contextmanager
def errors_to_exit_codes() -> Iterator[None]:
    """Every error a command meets becomes one line on stderr and a documented exit
    code, never a traceback (``-vv`` logs the traceback at debug level)."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception) and not _torch_error(exc):
            raise  # KeyboardInterrupt, SystemExit: not a command's error
        logger.debug("the command failed", exc_info=True)
        click.echo(f"error: {one_line(exc)}", err=True)
        sys.exit(exit_code(_unwrap(exc)))


def store_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Common options of every store command: --storage-option, --deadline and --json."""

    @click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec option (repeatable; JSON values allowed).",
    )
    @click.option(
        "--deadline",
        "request_deadline",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="SECONDS",
        help="Seconds each store request may take with its retries "
        "(RetryPolicy.request_deadline; default 300, or the config's [retry]).",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
    @click.pass_obj
    @functools.wraps(fn)
    def wrapper(
        obj: dict[str, Any],
        storage_option: tuple[str, ...],
        request_deadline: float | None,
        as_json: bool,
        **kw: Any,
    ) -> Any:
        ctx = CommandContext(
            obj.get("config"), parse_options(storage_option), as_json, request_deadline
        )
        with errors_to_exit_codes():
            return fn(ctx, **kw)

    return wrapper


def progress_bar(total: int, label: str, quiet: bool) -> Any:
    """A progress bar on stderr (drawn only on a terminal, never with --json)."""
    if quiet:
        return contextlib.nullcontext(None)
    return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=False)


def committed_manifest(loc: Any) -> Any:
    """The committed manifest at ``loc`` (read once; the command passes it on)."""
    from objckpt.ops.verify import open_manifest
    from objckpt.writers import open_store

    store = open_store(loc)
    try:
        return open_manifest(store)
    finally:
        store.close()
