"""The CLI as documented (#35 item 6): a mistake in the command line is a usage
error (exit 2) naming what is wrong, before any request; a bucket that does not
exist is named with exit 3 by every command, on either side of a copy; a request
gets the CLI's own 60 s deadline; on a terminal, a silent command says what it is
waiting for, and off a terminal it does not."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

import objckpt.cli.common
from objckpt.cli import main
from objckpt.cli.common import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    REQUEST_DEADLINE,
    CommandContext,
)
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.servers import offline_env, s3_test_options

MISSING = "no-such-bucket-objckpt"


def _flags(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--storage-option", f"{k}={json.dumps(v)}")]


def _invoke(target: StoreTarget, *args: str, extra: tuple[str, ...] = ()) -> Result:
    """The command with the target's options, then ``extra`` flags (which win)."""
    return CliRunner().invoke(
        main, [*args, *_flags(target.storage_options), *extra], catch_exceptions=False
    )


def _missing(target: StoreTarget, name: str = "run") -> str:
    return target.url(name).replace(f"//{target.bucket}/", f"//{MISSING}/")


# -- usage errors: exit 2, naming the argument or option -------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["ls", ""], "ROOT"),
        (["ls", "nope://b/run"], "unknown protocol 'nope'"),
        (["info", "s3://"], "names no bucket"),
        (["verify", "   "], "CKPT"),
        (["gc", "bogus://b/run"], "unknown protocol 'bogus'"),
        (["cp", "s3://objckpt-test/t/a", ""], "DST"),
        (["export", "s3://objckpt-test/t/a", "nope://x/y"], "DEST_URL"),
    ],
    ids=["empty", "scheme", "no-bucket", "blank", "gc-scheme", "cp-dst-empty", "export-dst"],
)
def test_a_bad_url_is_a_usage_error(s3_bucket: StoreTarget, args: list[str], named: str) -> None:
    out = _invoke(s3_bucket, *args)
    assert out.exit_code == EXIT_USAGE, out.output
    assert named in out.stderr and "Usage:" in out.stderr, out.stderr
    assert "Traceback" not in out.output


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ("client_kwargs={bad", "the value of client_kwargs is not valid JSON"),
        ('client_kwargs="eu-west-1"', "client_kwargs must be a JSON object"),
        ('secret="unterminated', "the value of secret is not valid JSON"),
        ("=value", "expected KEY=VALUE"),
        ("AKIAPASTEDWITHOUTKEY", "expected KEY=VALUE"),
    ],
    ids=["broken-json", "kwargs-not-object", "broken-string", "no-key", "no-equals"],
)
def test_a_malformed_storage_option_is_a_usage_error(
    s3_bucket: StoreTarget, option: str, named: str
) -> None:
    """Before: ``client_kwargs={bad`` reached s3fs as a string and failed at the first
    request with ``AttributeError: 'str' object has no attribute 'get'`` (exit 4)."""
    out = _invoke(s3_bucket, "ls", s3_bucket.url("run"), extra=("--storage-option", option))
    assert out.exit_code == EXIT_USAGE, out.output
    assert named in out.stderr and "--storage-option" in out.stderr, out.stderr
    assert "AttributeError" not in out.output and "unterminated" not in out.output
    assert "AKIAPASTED" not in out.output  # a value pasted alone may be a secret


@pytest.mark.parametrize(
    ("command", "option", "hint"),
    [
        ("ls", "endpoint_ulr=http://127.0.0.1:1", "did you mean endpoint_url"),
        ("info", "bogus_option=1", ""),
        ("verify", "regoin_name=us-east-1", ""),
    ],
)
def test_an_unknown_option_is_a_usage_error_naming_it(
    s3_bucket: StoreTarget, command: str, option: str, hint: str
) -> None:
    """Before: aiobotocore's ``TypeError: AioSession.__init__() got an unexpected
    keyword argument`` at the first request, exit 4."""
    url = s3_bucket.url("run") if command == "ls" else s3_bucket.url("run/step-1")
    out = _invoke(s3_bucket, command, url, extra=("--storage-option", option))
    name = option.partition("=")[0]
    assert out.exit_code == EXIT_USAGE, out.output
    assert f"{name} is not an option of the s3:// backend" in out.stderr, out.stderr
    assert hint in out.stderr and "TypeError" not in out.output


def test_options_s3fs_passes_to_its_session_are_known(s3_bucket: StoreTarget) -> None:
    """``profile`` is no parameter of s3fs's constructor: s3fs hands it to
    aiobotocore's session. Refusing it would refuse the config file's ``profile``."""
    out = _invoke(
        s3_bucket, "ls", s3_bucket.url("run"), extra=("--storage-option", "profile=no-such-one")
    )
    assert out.exit_code == EXIT_ERROR, out.output  # botocore's ProfileNotFound, not usage
    assert "not an option" not in out.stderr and "ProfileNotFound" in out.stderr


def test_demo_checks_its_url_and_options_too(s3_bucket: StoreTarget) -> None:
    bad_url = CliRunner().invoke(main, ["demo", "--url", "nope://b/run"])
    assert bad_url.exit_code == EXIT_USAGE and "--url" in bad_url.stderr, bad_url.output
    bad_option = CliRunner().invoke(
        main, ["demo", "--url", s3_bucket.url("demo"), "--storage-option", "bogus=1"]
    )
    assert bad_option.exit_code == EXIT_USAGE, bad_option.output
    assert "bogus is not an option" in bad_option.stderr


# -- a missing bucket: exit 3, named, for every command ---------------------------------


@pytest.fixture
def committed(s3_bucket: StoreTarget, tmp_path) -> str:
    """A committed step in the test bucket (imported from a small safetensors file)."""
    src = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(src))
    step = s3_bucket.url(f"run/{step_name(1)}")
    assert _invoke(s3_bucket, "import", str(src), step).exit_code == 0
    return step


@pytest.mark.parametrize(
    "command",
    [
        "ls",
        "info",
        "verify",
        "gc",
        "rm",
        "cp-src",
        "cp-dst",
        "export-src",
        "export-dst",
        "import-dst",
    ],
)
def test_a_missing_bucket_is_named_by_every_command(
    s3_bucket: StoreTarget, committed: str, tmp_path, command: str
) -> None:
    """Before: ``info``, ``verify``, ``cp`` and ``export`` of a step in a missing
    bucket said "no checkpoint at ..." (the typo'd bucket unnamed), and a copy or
    an export to one failed with exit 4 as a generic store error."""
    step = f"run/{step_name(1)}"
    gone = _missing(s3_bucket, step)
    src = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(src))
    args = {
        "ls": ["ls", _missing(s3_bucket)],
        "info": ["info", gone],
        "verify": ["verify", gone],
        "gc": ["gc", _missing(s3_bucket)],
        "rm": ["rm", "--yes", gone],
        "cp-src": ["cp", gone, str(tmp_path / "copy")],
        "cp-dst": ["cp", committed, gone],
        "export-src": ["export", gone, str(tmp_path / "export")],
        "export-dst": ["export", committed, _missing(s3_bucket, "export")],
        "import-dst": ["import", str(src), gone],
    }[command]
    out = _invoke(s3_bucket, *args)
    assert out.exit_code == EXIT_NOT_FOUND, out.output
    assert f"bucket '{MISSING}'" in out.stderr and "does not exist" in out.stderr, out.stderr
    assert "no checkpoint at" not in out.stderr and "Traceback" not in out.output


def test_a_step_missing_from_a_bucket_that_exists_is_still_no_checkpoint(
    s3_bucket: StoreTarget,
) -> None:
    out = _invoke(s3_bucket, "info", s3_bucket.url(f"run/{step_name(7)}"))
    assert out.exit_code == EXIT_NOT_FOUND, out.output
    assert "no checkpoint at" in out.stderr and "bucket" not in out.stderr, out.stderr


# -- the CLI's deadline, and what a silent command says ---------------------------------


def test_the_cli_gives_each_request_60_s_whatever_the_config_says(tmp_path) -> None:
    """The library's 300 s is a training job's bound; a person waits about a minute.
    The config's other retry settings still apply; ``--deadline`` overrides."""
    config = tmp_path / "run.toml"
    config.write_text('root = "s3://b/run"\n[retry]\nattempts = 2\nrequest_deadline = 900\n')
    plain = CommandContext(None, {}, False)
    assert REQUEST_DEADLINE == 60.0 and plain.retry.request_deadline == 60.0
    configured = CommandContext(str(config), {}, False)
    assert configured.retry.request_deadline == 60.0 and configured.retry.attempts == 2
    assert CommandContext(str(config), {}, False, 7.5).retry.request_deadline == 7.5


def test_off_a_terminal_a_silent_command_fails_in_its_deadline_without_the_line(
    black_hole: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CliRunner's stderr is no terminal: the waiting line (due after 0.05 s here,
    long before the deadline) must not appear; the deadline ends the command."""
    monkeypatch.setattr(objckpt.cli.common, "WAIT_NOTICE_AFTER", 0.05)
    deadline = 2.0
    started = time.monotonic()
    args = ["ls", "s3://objckpt-test/run", "--deadline", str(deadline)]
    out = CliRunner().invoke(
        main, [*args, *_flags(s3_test_options(black_hole))], catch_exceptions=False
    )
    # The bound is what is tested: two requests (the listing, then the bucket check
    # of an empty answer) at most, plus 10 s for a loaded machine.
    assert time.monotonic() - started <= 2 * deadline * 1.1 + 10.0
    assert out.exit_code == EXIT_ERROR, out.output
    assert black_hole in out.stderr and "request_deadline" in out.stderr, out.stderr
    assert "waiting for" not in out.output


def test_on_a_terminal_a_silent_command_says_what_it_waits_for(black_hole: str) -> None:
    """The real command in a child process whose stderr is a pseudo-terminal: after
    WAIT_NOTICE_AFTER seconds of silence one line names the URL and the deadline,
    then the deadline ends the command."""
    deadline = objckpt.cli.common.WAIT_NOTICE_AFTER + 5.0
    url = "s3://objckpt-test/run/step-0000000001"
    leader, follower = pty.openpty()
    env = {**os.environ, **offline_env()}
    argv = [sys.executable, "-m", "objckpt.cli", "info", url, "--deadline", str(deadline)]
    proc = subprocess.Popen(
        argv + _flags(s3_test_options(black_hole)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        code = proc.wait(timeout=120)
    text = seen.decode(errors="replace")
    assert code == EXIT_ERROR, text
    assert f"waiting for {url} ..." in text, text
    assert f"gives up after {deadline:g} s" in text
    assert text.index("waiting for") < text.index("error:")


# -- the config file through the CLI -----------------------------------------------------


def test_a_nested_secret_in_the_config_stops_the_cli_naming_the_key(tmp_path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        'root = "s3://b/run"\n[storage]\n'
        'options = { client_kwargs = { aws_secret_access_key = "objckpt-leaky-value" } }\n'
    )
    out = CliRunner().invoke(main, ["--config", str(config), "ls"], catch_exceptions=False)
    assert out.exit_code == EXIT_ERROR, out.output
    assert "storage.options.client_kwargs.aws_secret_access_key" in out.stderr, out.stderr
    assert "objckpt-leaky-value" not in out.output
