"""Every CLI command against the moto server: output, --json, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers import cli_env, load

from objckpt import CheckpointManager, Location
from objckpt.cli import main
from objckpt.format.steps import step_name
from objckpt.testing import MotoServer
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.servers import TEST_KEY, TEST_SECRET


def _state(step: int) -> dict:
    return {"w": torch.full((32, 16), float(step)), "b": torch.arange(7) + step, "step": step}


@pytest.fixture
def run_root(s3_bucket: StoreTarget) -> str:
    """A root with committed steps 1 and 2 and an incomplete step 3."""
    root = s3_bucket.url("run")
    with CheckpointManager(root, storage_options=s3_bucket.storage_options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), user_metadata={"loss": 0.5 / step}).result(timeout=120)
    fs = Location.parse(root, s3_bucket.storage_options).open_fs(fresh=True)
    fs.pipe_file(f"{Location.parse(root).path}/{step_name(3)}/__0_0.00000000deadbeef.distcp", b"x")
    return root


def test_ls_lists_committed_and_incomplete_steps(cli, run_root: str) -> None:
    out = cli("ls", run_root)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "committed" in lines[1] and lines[1].split()[0] == "1"
    assert "incomplete" in lines[3] and lines[3].split()[0] == "3"
    doc = json.loads(cli("ls", run_root, "--json").stdout)
    assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(1, True), (2, True), (3, False)]
    assert doc["steps"][0]["bytes"] > 2048 and doc["steps"][0]["modified"]


def test_info_summarises_manifest_and_tensors(cli, run_root: str) -> None:
    doc = json.loads(cli("info", f"{run_root}/{step_name(2)}", "--json").stdout)
    assert doc["world_size"] == 1 and doc["user"] == {"loss": 0.25}
    entries = {e["name"]: e for e in doc["entries"]}
    assert entries["w"]["shape"] == [32, 16] and entries["w"]["dtype"] == "float32"
    assert entries["b"]["dtype"] == "int64" and entries["step"]["dtype"] == "bytes"
    assert doc["requests"]["requests"]["PUT"] >= 2  # payload, index (.metadata follows the commit)
    human = cli("info", f"{run_root}/{step_name(2)}").stdout
    assert "world size 1" in human and "float32" in human
    assert "save cost" in human and "PUT" in human


def _payloads(moto_server: MotoServer, bucket: str, ckpt: str) -> list[str]:
    prefix = Location.parse(ckpt).path.split("/", 1)[1]
    listing = moto_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listing["Contents"] if o["Key"].endswith(".distcp"))


def test_verify_passes_then_names_each_bad_object(
    cli, run_root: str, moto_server: MotoServer, s3_bucket: StoreTarget, tmp_path
) -> None:
    client = moto_server.boto3_client()
    flipped, truncated = f"{run_root}/{step_name(1)}", f"{run_root}/{step_name(2)}"
    out = cli("verify", flipped)
    assert out.exit_code == 0 and "ok" in out.stdout
    # Flip one byte of step 1's payload; cut five bytes off step 2's.
    key = _payloads(moto_server, s3_bucket.bucket, flipped)[0]
    body = bytearray(client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read())
    body[-10] ^= 0xFF
    client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=bytes(body))
    out = cli("verify", flipped, "--json")
    assert out.exit_code == 1
    doc = json.loads(out.stdout)
    assert [f["key"] for f in doc["failures"]] == [key.rsplit("/", 1)[-1]]
    assert "CRC32C" in doc["failures"][0]["problem"]
    human = cli("verify", flipped)
    assert human.exit_code == 1 and f"FAIL {run_root}/{step_name(1)}/" in human.stdout
    # A corrupt source never becomes a committed copy.
    copy = cli("cp", flipped, f"file://{tmp_path}/copy")
    assert copy.exit_code == 4 and "CRC32C" in copy.output
    assert not (tmp_path / "copy" / "manifest.json").exists()

    key = _payloads(moto_server, s3_bucket.bucket, truncated)[0]
    short = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()[:-5]
    client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=short)
    doc = json.loads(cli("verify", truncated, "--json").stdout)
    assert not doc["ok"] and "size" in doc["failures"][0]["problem"]
    assert doc["failures"][0]["actual_size"] == doc["failures"][0]["size"] - 5


def test_gc_is_a_dry_run_until_apply(cli, run_root: str) -> None:
    doc = json.loads(cli("gc", run_root, "--grace", "0", "--json").stdout)
    assert doc["dry_run"] and doc["deleted"] == [f"{step_name(3)}/__0_0.00000000deadbeef.distcp"]
    assert json.loads(cli("ls", run_root, "--json").stdout)["steps"][-1]["step"] == 3  # still there
    young = cli("gc", run_root, "--apply")  # default grace: the object is too young to go
    assert young.exit_code == 0 and "removed 0 objects" in young.stdout
    out = cli("gc", run_root, "--apply", "--grace", "0")
    assert out.exit_code == 0 and "removed 1 objects" in out.stdout
    steps = json.loads(cli("ls", run_root, "--json").stdout)["steps"]
    assert [s["step"] for s in steps] == [1, 2]


def test_rm_deletes_one_checkpoint_and_refuses_trees(cli, run_root: str) -> None:
    out = cli("rm", f"{run_root}/{step_name(1)}", "--yes")
    assert out.exit_code == 0 and "deleted" in out.stdout
    assert [s["step"] for s in json.loads(cli("ls", run_root, "--json").stdout)["steps"]] == [2, 3]
    missing = cli("rm", f"{run_root}/{step_name(1)}", "--yes")
    assert missing.exit_code == 3 and "no checkpoint at" in missing.output
    tree = cli("rm", run_root, "--yes")
    assert tree.exit_code == 4 and "not one checkpoint" in tree.output
    unconfirmed = CliRunner().invoke(main, ["rm", f"{run_root}/{step_name(2)}"], input="n\n")
    assert unconfirmed.exit_code == 1  # aborted at the prompt; nothing deleted
    assert 2 in [s["step"] for s in json.loads(cli("ls", run_root, "--json").stdout)["steps"]]


def test_cp_copies_between_stores_and_checks(cli, run_root: str, tmp_path) -> None:
    src = f"{run_root}/{step_name(2)}"
    dst = f"file://{tmp_path}/copy"
    out = cli("cp", src, dst, "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["objects"] >= 2
    got = {"w": torch.zeros(32, 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    load(got, dst, StoreTarget(root=dst, storage_options={}))
    assert torch.equal(got["w"], _state(2)["w"]) and got["step"] == 2
    assert cli("verify", dst).exit_code == 0
    again = cli("cp", src, dst)  # the same checkpoint again: nothing to do
    assert again.exit_code == 0 and "already holds this checkpoint" in again.output
    other = cli("cp", f"{run_root}/{step_name(1)}", dst)
    assert other.exit_code == 4 and "already holds a committed checkpoint" in other.output
    assert cli("cp", f"{run_root}/{step_name(1)}", dst, "--overwrite").exit_code == 0
    got["step"] = -1
    load(got, dst, StoreTarget(root=dst, storage_options={}))
    assert got["step"] == 1
    uncommitted = cli("cp", f"{run_root}/{step_name(3)}", f"file://{tmp_path}/c3")
    assert uncommitted.exit_code == 3 and "never committed" in uncommitted.output
    assert not (tmp_path / "c3").exists()


def test_config_file_names_the_root(cli, run_root: str, tmp_path, monkeypatch) -> None:
    config = tmp_path / "objckpt.toml"
    config.write_text(f'root = "{run_root}"\n[gc]\ngrace = 0\n')
    doc = json.loads(cli("--config", str(config), "ls", "--json").stdout)
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3]
    monkeypatch.setenv("OBJCKPT_CONFIG", str(config))
    assert json.loads(cli("gc", "--json").stdout)["deleted"]  # grace 0 from the config
    bad = tmp_path / "bad.toml"
    bad.write_text('root = "s3://b/r"\n[storage]\noptions = { secret = "x" }\n')
    out = cli("--config", str(bad), "ls")
    assert out.exit_code == 4 and "looks like a credential" in out.output


def test_storage_option_flag_and_usage_errors(moto_server: MotoServer, run_root: str) -> None:
    runner = CliRunner()
    opts = [
        f"--storage-option=endpoint_url={moto_server.endpoint_url}",
        f"--storage-option=key={TEST_KEY}",
        f"--storage-option=secret={TEST_SECRET}",
        '--storage-option=client_kwargs={"region_name": "us-east-1"}',
    ]
    out = runner.invoke(main, ["ls", run_root, "--json", *opts])
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.stdout)["steps"]) == 3
    bad = runner.invoke(main, ["ls", run_root, "--storage-option", "novalue"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
    assert runner.invoke(main, ["ls"]).exit_code == 2  # no ROOT and no config
    assert runner.invoke(main, ["verify"]).exit_code == 2


def test_installed_entry_point(moto_server: MotoServer, run_root: str) -> None:
    exe = shutil.which("objckpt") or os.path.join(os.path.dirname(sys.executable), "objckpt")
    env = {**os.environ, **cli_env(moto_server)}
    done = subprocess.run(
        [exe, "verify", f"{run_root}/{step_name(1)}", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    missing = subprocess.run(
        [exe, "info", f"{run_root}/{step_name(9)}"], capture_output=True, text=True, env=env
    )
    assert missing.returncode == 3 and "no checkpoint at" in missing.stderr


def test_ls_local_shows_which_steps_are_only_on_the_local_tier(
    cli, s3_bucket: StoreTarget, tmp_path
) -> None:
    from objckpt import AsyncOptions, LocalTier, RetentionPolicy

    root, local = s3_bucket.url("tiered"), str(tmp_path / "nvme")
    with CheckpointManager(
        root,
        storage_options=s3_bucket.storage_options,
        async_options=AsyncOptions(workers=1),
        local=LocalTier(local, retention=RetentionPolicy(keep_last=3), promote_every=2),
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
    doc = json.loads(cli("ls", root, "--local", local, "--json").stdout)
    where = [(s["step"], s["committed"], s["local"]) for s in doc["steps"]]
    assert where == [(1, False, True), (2, True, True), (3, False, True)], where
    assert doc["local_tier"]["local_latest"] == 3 and doc["local_tier"]["durable_latest"] == 2
    assert doc["local_tier"]["steps_not_durable"] == 1
    out = cli("ls", root, "--local", local)
    assert out.exit_code == 0, out.output
    assert "local only" in out.stdout and "1 local step(s) newer than the root's" in out.stdout
    bad = CliRunner().invoke(main, ["ls", root, "--local", "s3://b/x"])
    assert bad.exit_code != 0 and "s3://b/x is not a local directory" in bad.output
