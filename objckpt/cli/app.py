"""The ``objckpt`` click group: global options, logging, and the commands it holds.

The group reads ``-v`` and ``--config`` once and hands the config path to every
command through click's context object; each command lives in the module of its
group (:mod:`objckpt.cli.inspect`, :mod:`objckpt.cli.verify`,
:mod:`objckpt.cli.maintain`, :mod:`objckpt.cli.export`, :mod:`objckpt.cli.demo`)
and is attached here, so those modules never import the group.

Logging goes to stderr through one handler that :class:`RedactingFilter` guards.
``-vv`` turns on every library's debug logging, and botocore's prints each request
with its ``Authorization`` header (the access key id and the signature) and its
signing steps (the canonical request holds the session token): a terminal log ends
up pasted into tickets, so what would let someone act as the user, or tell who the
user is, is cut out where the line is printed, whichever library logged it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable

import click

from objckpt.cli.demo import demo
from objckpt.cli.export import export_command, import_command, stock_metadata_command
from objckpt.cli.inspect import info_command, ls_command
from objckpt.cli.maintain import cp_command, gc_command, rm_command
from objckpt.cli.verify import verify_command

__all__ = ["RedactingFilter", "main"]

_HIDDEN = "<redacted>"
# Where credentials stand in what HTTP clients log: the value of a credential header
# or query parameter (the session token's too) to the end of its quote or line, and
# SigV4's key id and signature wherever they stand (URL-encoded or not).
_PATTERNS = (
    re.compile(
        r"""(?P<head>\b(?:authorization|x-amz-security-token|x-goog-api-key)['"]?\s*[:=]\s*b?['"]?)"""
        r"""[^'"\r\n]+""",
        re.IGNORECASE,
    ),
    re.compile(r"(?P<head>\b(?:X-Amz-)?Credential=)[^/\s,'\"&%]+", re.IGNORECASE),
    re.compile(r"(?P<head>\b(?:X-Amz-)?Signature=)[0-9A-Za-z%+/=]+", re.IGNORECASE),
    # Azure: a SAS token's signature and a connection string's account key.
    re.compile(r"(?P<head>[?&]sig=)[0-9A-Za-z%+/=]+", re.IGNORECASE),
    re.compile(r"(?P<head>\bAccountKey=)[^;\s'\"]+", re.IGNORECASE),
)
# botocore's signing internals: the canonical request (with the session token), the
# string to sign and the signature itself. Nothing in them helps a person debug.
_DROPPED = ("botocore.auth",)
# Credentials from the standard environment, hidden wherever they appear.
_ENV_SECRETS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
)
# Shorter values are hidden only by the patterns: a literal "abc" would cut words.
_MIN_SECRET = 8


class RedactingFilter(logging.Filter):
    """Rewrites each record its handler prints so that no credential is in it.

    Patterns hide the ``Authorization`` header, SigV4's ``Credential=`` key id and
    ``Signature=``, and session tokens, in any logger's message and traceback;
    known values (the ``AWS_*`` credentials of the environment and the credential
    options the command was given) are hidden literally wherever they appear;
    botocore's signing records are dropped whole.

    Args:
        secrets: Values to hide literally (short ones are left to the patterns).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets: set[str] = set()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """Hide these values too, from the next record on."""
        self._secrets |= {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET}

    def redact(self, text: str) -> str:
        for pattern in _PATTERNS:
            text = pattern.sub(lambda m: m.group("head") + _HIDDEN, text)
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, _HIDDEN)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_DROPPED):
            return False
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: the handler reports it, args unprinted
            record.args = None
            message = str(record.msg)
        record.msg, record.args = self.redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def _log_to_stderr(ctx: click.Context, verbose: int) -> RedactingFilter | None:
    """One redacting handler on the root logger for this invocation, removed (and
    the root's level restored) when it ends.

    A process whose root logger already has handlers configured its own logging
    (a program calling :func:`main` in-process, a test runner): as with
    :func:`logging.basicConfig`, it is left as it is, so ``-v`` does not lower its
    root level and hand botocore's unredacted debug records to its handlers.
    """
    root = logging.getLogger()
    if root.handlers:
        return None
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    redact = RedactingFilter(os.environ.get(name, "") for name in _ENV_SECRETS)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(redact)
    before = root.level
    root.addHandler(handler)
    root.setLevel(level)

    def restore() -> None:
        root.removeHandler(handler)
        root.setLevel(before)

    ctx.call_on_close(restore)
    return redact


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
    ctx.obj = {"config": config, "redact": _log_to_stderr(ctx, verbose)}


main.add_command(ls_command)
main.add_command(info_command)
main.add_command(verify_command)
main.add_command(gc_command)
main.add_command(rm_command)
main.add_command(cp_command)
main.add_command(export_command)
main.add_command(import_command)
main.add_command(stock_metadata_command)
main.add_command(demo)
