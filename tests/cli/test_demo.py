"""The README's first command works, in-process and through the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from objckpt.cli import main
from objckpt.demo import run_demo
from objckpt.errors import ConfigurationError


def test_demo_restores_matching_weights(s3_bucket) -> None:
    result = run_demo(
        steps=40,
        every=20,
        width=32,
        url=s3_bucket.url("demo"),
        storage_options=s3_bucket.storage_options,
    )
    assert [s.step for s in result.saves] == [20, 40]
    assert result.restored_step == 40 and result.weights_match
    assert result.kept_steps == (20, 40)


def test_cli_demo_with_embedded_server() -> None:
    out = CliRunner().invoke(
        main, ["demo", "--steps", "50", "--every", "10", "--width", "16", "--json"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert doc["weights_match"] is True and doc["restored_step"] == 50 and len(doc["saves"]) == 5
    assert doc["kept_steps"] == [30, 40, 50]  # retention: keep_last=3


def test_cli_rejects_bad_arguments() -> None:
    out = CliRunner().invoke(main, ["demo", "--steps", "5", "--every", "10"])
    assert out.exit_code != 0 and "--every" in out.output


def test_demo_refuses_a_used_root(s3_bucket) -> None:
    kw = {"steps": 20, "every": 20, "width": 8, "storage_options": s3_bucket.storage_options}
    run_demo(url=s3_bucket.url("used"), **kw)
    with pytest.raises(ConfigurationError, match="needs an empty root"):
        run_demo(url=s3_bucket.url("used"), **kw)
