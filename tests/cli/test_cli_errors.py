"""The CLI as a newcomer meets it: a typo'd bucket, a step that exists, a failure
that is not objckpt's own. Each prints one line naming what is wrong and exits
with the documented code (3 not found, 4 any other error), never a traceback."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

from objckpt import CheckpointManager, errors
from objckpt.cli import main
from objckpt.cli.common import EXIT_ERROR, EXIT_NOT_FOUND
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget


def _invoke(target: StoreTarget, *args: str) -> Result:
    opts = [
        x
        for k, v in target.storage_options.items()
        for x in ("--storage-option", f"{k}={json.dumps(v)}")
    ]
    return CliRunner().invoke(main, [*args, *opts], catch_exceptions=False)


def _missing(target: StoreTarget) -> str:
    return target.url("run").replace(f"//{target.bucket}/", "//no-such-bucket-objckpt/")


def test_ls_of_a_missing_bucket_names_it_and_exits_3(s3_bucket: StoreTarget) -> None:
    out = _invoke(s3_bucket, "ls", _missing(s3_bucket))
    assert out.exit_code == EXIT_NOT_FOUND, out.output
    assert "bucket 'no-such-bucket-objckpt'" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.output
    # An existing bucket with nothing under the root is still an empty root.
    empty = _invoke(s3_bucket, "ls", s3_bucket.url("nothing-here"))
    assert empty.exit_code == 0 and "no steps under" in empty.stdout


def test_gc_and_the_manager_refuse_a_missing_bucket(s3_bucket: StoreTarget) -> None:
    assert _invoke(s3_bucket, "gc", _missing(s3_bucket)).exit_code == EXIT_NOT_FOUND
    with pytest.raises(errors.BucketNotFoundError, match="no-such-bucket-objckpt"):
        CheckpointManager(_missing(s3_bucket), storage_options=s3_bucket.storage_options)


def test_demo_to_a_missing_bucket_exits_3(s3_bucket: StoreTarget) -> None:
    out = _invoke(s3_bucket, "demo", "--steps", "2", "--every", "1", "--url", _missing(s3_bucket))
    assert out.exit_code == EXIT_NOT_FOUND, out.output
    assert "no-such-bucket-objckpt" in out.stderr and "Traceback" not in out.output


def test_import_onto_a_committed_step_is_one_line_and_exit_4(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    src = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(src))
    step = s3_bucket.url(f"run/{step_name(1)}")
    assert _invoke(s3_bucket, "import", str(src), step).exit_code == 0
    again = _invoke(s3_bucket, "import", str(src), step)
    assert again.exit_code == EXIT_ERROR, again.output
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and step in lines[0], lines
    assert "CheckpointException" not in again.output and "Traceback" not in again.output


def test_a_failure_that_is_not_objckpts_own_is_one_line_too(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net under every command: an exception of no objckpt type (a bug,
    or a library error objckpt does not translate) is printed as its type and
    message on one line, exit 4, not as a traceback."""
    import objckpt.format.steps

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a key nobody expected")

    monkeypatch.setattr(objckpt.format.steps, "steps_of", broken)
    out = _invoke(s3_bucket, "ls", s3_bucket.url("run"))
    assert out.exit_code == EXIT_ERROR, out.output
    assert out.stderr.strip().splitlines() == ["error: KeyError: 'a key nobody expected'"]
    assert "Traceback" not in out.output
