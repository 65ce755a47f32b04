"""What every store command of the CLI shares: options, context, exit codes, output.

A store command gets ``--storage-option`` and ``--json`` from :func:`store_command`,
resolves its URLs through one :class:`CommandContext` (config file first, then
``--storage-option``), prints through :meth:`CommandContext.emit` (one JSON document
with ``--json``, lines for people otherwise) and turns objckpt errors into the
documented exit codes. Keeping this in one place is what keeps the commands' flags,
messages and exit codes alike.

A person at a terminal is the CLI's user, so what a person would call a mistake in
the command line is a usage error (exit 2) here, before any request: a URL that does
not parse, a ``--storage-option`` that is not ``KEY=VALUE`` or whose JSON is broken,
an option name the backend does not take. Each request gets :data:`REQUEST_DEADLINE`
(``--deadline``), not the library's five minutes, and a command that has shown
nothing for :data:`WAIT_NOTICE_AFTER` seconds says on a terminal what it waits for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import click

from objckpt.errors import (
    BucketNotFoundError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ConfigurationError,
    ObjckptError,
)
from objckpt.writers.location import Location, backend_options
from objckpt.writers.retry import RetryPolicy
from objckpt.writers.translate import describe

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_USAGE",
    "REQUEST_DEADLINE",
    "WAIT_NOTICE_AFTER",
    "CommandContext",
    "WaitNotice",
    "check_option_names",
    "committed_manifest",
    "errors_to_exit_codes",
    "exit_code",
    "one_line",
    "parse_options",
    "parse_url",
    "store_command",
]

logger = logging.getLogger(__name__)

EXIT_CHECK_FAILED = 1
#: click's own code for a usage error; a bad URL or storage option gets it too.
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4

#: Seconds one store request may take with its retries in a CLI command unless
#: ``--deadline`` says otherwise: a person waits about a minute for an answer, not
#: the library's five (``RetryPolicy.request_deadline``, sized for a training job).
REQUEST_DEADLINE = 60.0
#: Seconds a command may show nothing before, on a terminal, a line says what it
#: waits for.
WAIT_NOTICE_AFTER = 3.0

_OPTION = "--storage-option"


def parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` pairs as a dict, each value JSON if it parses.

    A value that starts like a JSON object, array or string must be valid JSON (a
    half-typed ``client_kwargs={bad`` is a mistake, not a string), and an option
    named ``*_kwargs`` must be a JSON object: backends pass those on as keywords.
    The messages name the option, never its value (it may be a secret).

    Args:
        pairs: The ``--storage-option`` values as given.

    Returns:
        The options by key; a value that is not JSON stays a string.

    Raises:
        click.BadParameter: A pair has no ``=`` or no key, broken JSON, or a
            ``*_kwargs`` value that is not an object.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Never the text itself: a value pasted without its key may be a secret.
            shown = "a value without a key" if sep else f"{len(pair)} characters without '='"
            raise click.BadParameter(f"expected KEY=VALUE, got {shown}", param_hint=_OPTION)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            if value.lstrip()[:1] in ("{", "[", '"'):
                raise click.BadParameter(
                    f"the value of {key} is not valid JSON ({exc.msg} at column {exc.colno})",
                    param_hint=_OPTION,
                ) from None
            out[key] = value
        if key.endswith("_kwargs") and not isinstance(out[key], dict):
            raise click.BadParameter(
                f"{key} must be a JSON object, e.g. {key}='{{...}}'",
                param_hint=_OPTION,
            )
    return out


def parse_url(url: str, what: str) -> Location:
    """``url`` parsed, or a usage error naming the argument ``what`` (exit 2).

    Raises:
        click.BadParameter: Empty, no bucket, a scheme fsspec does not know.
    """
    try:
        return Location.parse(url)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint=what) from None


def check_option_names(loc: Location, options: dict[str, Any]) -> None:
    """Refuse a ``--storage-option`` name the backend of ``loc`` does not take.

    Raises:
        click.BadParameter: Naming the first unknown option (and what it may have
            meant), before any request.
    """
    known = backend_options(loc.protocol)
    if known is None:
        return
    for name in sorted(set(options) - known):
        near = difflib.get_close_matches(name, sorted(known), n=3)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise click.BadParameter(
            f"{name} is not an option of the {loc.protocol}:// backend{hint}",
            param_hint=_OPTION,
        )


class WaitNotice:
    """One line on stderr, on a terminal only, when a command has shown nothing for
    ``after`` seconds: what it is waiting for and how long it will wait.

    A silent endpoint otherwise leaves a person looking at an empty terminal for the
    whole deadline. The line is not for scripts (stderr not a terminal), and it is
    not printed once the command shows something of its own (a result, a progress
    bar, a prompt): it would land in the middle of it.
    """

    def __init__(self, after: float, deadline: float, enabled: bool) -> None:
        self._after = after
        self._deadline = deadline
        self._enabled = enabled
        self._lock = threading.Lock()
        self._what: str | None = None
        self._timer: threading.Timer | None = None

    def waiting_for(self, url: str) -> None:
        """Name the store URL the command is about to ask (the newest one is shown)."""
        with self._lock:
            self._what = url

    def start(self) -> None:
        if not self._enabled:
            return
        with self._lock:
            self._timer = threading.Timer(self._after, self._say)
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        """No line from now on (the command shows its own output, or ended)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _say(self) -> None:
        with self._lock:
            if self._timer is None or self._what is None:
                return
            self._timer = None
            what = self._what
        click.echo(
            f"waiting for {what} ... (each request gives up after {self._deadline:g} s, "
            "--deadline)",
            err=True,
        )


@dataclasses.dataclass(frozen=True)
class CommandContext:
    """What the group's options give every command."""

    config_path: str | None
    options: dict[str, Any]
    as_json: bool
    #: ``--deadline``: each request's deadline with its retries (default :data:`REQUEST_DEADLINE`).
    request_deadline: float | None = None
    #: Says on a terminal what a silent command waits for; off by default.
    notice: WaitNotice = dataclasses.field(
        default_factory=lambda: WaitNotice(WAIT_NOTICE_AFTER, REQUEST_DEADLINE, False),
        repr=False,
        compare=False,
    )
    #: The store locations the command resolved, in order (for the missing-bucket check).
    resolved: list[Location] = dataclasses.field(default_factory=list, repr=False, compare=False)
    #: The log filter that hides credentials (``-v``), told the config's too.
    redact: Any = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def config(self) -> Any:
        """The loaded config file (read on first use), or None without ``--config``.
        Credential values it takes from the environment (``storage.env``) are added to
        the log filter, as ``--storage-option`` ones are."""
        from objckpt.ops.run.config import load_config

        config = load_config(self.config_path) if self.config_path else None
        if config is not None and self.redact is not None:
            self.redact.add(_credential_values(dict(config.storage_options)))
            for backup in config.backups:
                self.redact.add(_credential_values(dict(backup.storage_options)))
        return config

    @functools.cached_property
    def retry(self) -> RetryPolicy:
        """How the command's requests are retried: the config's ``[retry]`` table,
        with each request (and its retries) bounded by ``--deadline``, by default
        :data:`REQUEST_DEADLINE`, so a silent endpoint fails the command in that
        time. The config's own ``request_deadline`` is the job's, not the CLI's."""
        policy = self.config.retry if self.config else RetryPolicy()
        deadline = REQUEST_DEADLINE if self.request_deadline is None else self.request_deadline
        return dataclasses.replace(policy, request_deadline=deadline)

    def storage_options(self, url: str, what: str = "URL") -> dict[str, Any]:
        """Options for ``url``: the config's, then --storage-option; none for local paths.

        Raises:
            click.BadParameter: ``url`` does not parse (``what`` names the argument),
                or a ``--storage-option`` name is not an option of its backend.
        """
        loc = parse_url(url, what)
        if loc.is_local:
            return {}
        check_option_names(loc, self.options)
        merged = dict(self.config.storage_options) if self.config else {}
        merged.update(self.options)
        self.resolved.append(dataclasses.replace(loc, storage_options=merged, retry=self.retry))
        self.notice.waiting_for(loc.url)
        return merged

    def location(self, url: str | None, what: str) -> Any:
        """The :class:`Location` of ``url``, or of the config's root when ``url`` is None.

        Raises:
            click.UsageError: No ``url`` and no config naming a root (``what`` names
                the missing argument), or ``url`` does not parse.
        """
        if url is None:
            if self.config is None:
                raise click.UsageError(f"give {what} or a config file (--config) naming the root")
            url = self.config.root
        return Location.parse(url, self.storage_options(url, what), self.retry)

    def emit(self, doc: Any, human: Callable[[], None]) -> None:
        """Print ``doc`` as JSON with ``--json``, else call ``human`` to print lines."""
        self.notice.stop()
        if self.as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        else:
            human()

    def progress_bar(self, total: int, label: str) -> Any:
        """A progress bar on stderr (drawn only on a terminal, never with --json)."""
        self.notice.stop()
        if self.as_json:
            return contextlib.nullcontext(None)
        return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=False)

    def confirm(self, question: str) -> None:
        """Ask on stderr; abort the command on no."""
        self.notice.stop()
        click.confirm(question, abort=True, err=True)

    def missing_bucket(self) -> BucketNotFoundError | None:
        """The error naming the first bucket of the command's stores that does not
        exist, or None. Asked only once the command found nothing where it looked:
        "no checkpoint at s3://typo/x" hides that the bucket itself is the mistake."""
        from objckpt.writers import open_store

        for loc in self.resolved:
            try:
                open_store(loc).require_bucket()
            except BucketNotFoundError as exc:
                return exc
            except Exception:  # the original error says more than this one would
                logger.debug("could not check the bucket of %s", loc.url, exc_info=True)
        return None


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
    from objckpt.dcp.torch_errors import unwrap as seen_through

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
def errors_to_exit_codes(ctx: CommandContext | None = None) -> Iterator[None]:
    """Every error a command meets becomes one line on stderr and a documented exit
    code, never a traceback (``-vv`` logs the traceback at debug level).

    With the command's ``ctx``, a checkpoint that is not there is first checked
    against its bucket: a missing bucket is named (exit 3 either way)."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception) and not _torch_error(exc):
            raise  # KeyboardInterrupt, SystemExit: not a command's error
        logger.debug("the command failed", exc_info=True)
        shown: BaseException = exc
        inner = _unwrap(exc)
        if (
            ctx is not None
            and isinstance(inner, CheckpointNotFoundError)
            and not isinstance(inner, CheckpointNotCommittedError)
        ):
            shown = ctx.missing_bucket() or exc
        click.echo(f"error: {one_line(shown)}", err=True)
        sys.exit(exit_code(_unwrap(shown)))


def store_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Common options of every store command: --storage-option, --deadline and --json.

    The command runs with a :class:`WaitNotice` (on when stderr is a terminal) and
    its errors become exit codes (:func:`errors_to_exit_codes`)."""

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
        help="Seconds each store request may take with its retries before the "
        f"command fails (default {REQUEST_DEADLINE:g}).",
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
        options = parse_options(storage_option)
        redact = obj.get("redact")
        if redact is not None:
            redact.add(_credential_values(options))
        deadline = REQUEST_DEADLINE if request_deadline is None else request_deadline
        notice = WaitNotice(WAIT_NOTICE_AFTER, deadline, _is_terminal(sys.stderr))
        ctx = CommandContext(
            obj.get("config"), options, as_json, request_deadline, notice, redact=redact
        )
        notice.start()
        try:
            with errors_to_exit_codes(ctx):
                return fn(ctx, **kw)
        finally:
            notice.stop()

    return wrapper


def _credential_values(options: Any) -> Iterator[str]:
    """The string values of credential-like keys in ``options``, at any depth (for
    the log filter to hide wherever they appear)."""
    from objckpt.ops.run.config import credentials_in

    return (value for _, value in credentials_in(options) if isinstance(value, str))


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def committed_manifest(loc: Any) -> Any:
    """The committed manifest at ``loc`` (read once; the command passes it on)."""
    from objckpt.ops.maintain.verify import open_manifest
    from objckpt.writers import open_store

    store = open_store(loc)
    try:
        return open_manifest(store)
    finally:
        store.close()
