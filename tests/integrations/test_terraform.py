"""terraform/: parses, keeps its safety settings, maps onto the config file, and
grants exactly the S3 actions objckpt's code issues (recorded through a proxy); the
Azure module's roles are scoped to the container.

`terraform fmt -check` and checkov run outside pytest (`make iac`): they need a
venv of their own (see the Makefile).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import hcl2
import pytest
import torch
from hcl2.utils import SerializationOptions

from objckpt import CheckpointManager, Location, RetentionPolicy, UploadOptions
from objckpt.format.layout import payload_key
from objckpt.format.steps import step_name
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.ops.run.config import parse_config
from objckpt.testing import MotoServer
from objckpt.testing.proxy import FaultProxy
from objckpt.writers import open_store

REPO = Path(__file__).resolve().parents[2]
TF = REPO / "terraform"
AWS = TF / "modules" / "aws-checkpoint-buckets"
GCP = TF / "modules" / "gcp-checkpoint-bucket"
AZURE = TF / "modules" / "azure-checkpoint-storage"
MODULES = (AWS, GCP, AZURE)
EXAMPLES = (TF / "examples" / "aws", TF / "examples" / "gcp", TF / "examples" / "azure")
_OPTIONS = SerializationOptions(
    strip_string_quotes=True, with_comments=False, explicit_blocks=False
)


def _parse(directory: Path) -> dict[str, list[Any]]:
    """Every top-level block of a module's .tf files, merged by block type."""
    merged: dict[str, list[Any]] = {}
    for path in sorted(directory.glob("*.tf")):
        with path.open() as f:
            doc = hcl2.load(f, serialization_options=_OPTIONS)
        for kind, blocks in doc.items():
            merged.setdefault(kind, []).extend(blocks if isinstance(blocks, list) else [blocks])
    return merged


def _blocks(doc: dict[str, list[Any]], kind: str, rtype: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for block in doc.get(kind, []):
        out.update(block.get(rtype, {}))
    return out


def _one(value: Any) -> Any:
    """A nested block (hcl2 gives lists of blocks)."""
    assert isinstance(value, list) and len(value) == 1, value
    return value[0]


def _variables(doc: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for block in doc.get("variable", []):
        out.update(block)
    return out


def _outputs(doc: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for block in doc.get("output", []):
        out.update(block)
    return out


# -- structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_modules_have_the_standard_structure(module: Path) -> None:
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
        assert (module / name).is_file(), f"{module.name} lacks {name}"
    versions = _parse(module)["terraform"][0]
    assert versions["required_version"].startswith(">=")


@pytest.mark.parametrize("directory", MODULES + EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_variable_is_typed_and_described(directory: Path) -> None:
    variables = _variables(_parse(directory))
    assert variables
    for name, body in variables.items():
        assert body.get("type"), f"{directory.name}: variable {name} has no type"
        assert len(body.get("description", "")) > 15, f"{directory.name}: {name} undescribed"
    for name, body in _outputs(_parse(directory)).items():
        assert body.get("description"), f"{directory.name}: output {name} undescribed"


@pytest.mark.parametrize(
    ("module", "validated"),
    [
        (
            AWS,
            {
                "primary_bucket_name",
                "replica_bucket_name",
                "run_prefix",
                "run_name",
                "backup_mode",
                "abort_incomplete_multipart_days",
                "noncurrent_version_days",
                "kms_deletion_window_days",
            },
        ),
        (
            GCP,
            {
                "project_id",
                "bucket_name",
                "topology",
                "data_locations",
                "backup_bucket_name",
                "backup_mode",
                "run_prefix",
                "run_name",
                "training_service_account",
                "abort_incomplete_multipart_days",
                "noncurrent_version_days",
            },
        ),
        (
            AZURE,
            {
                "storage_account_name",
                "container_name",
                "account_replication_type",
                "replica_storage_account_name",
                "backup_mode",
                "run_prefix",
                "run_name",
                "training_principals",
                "reader_principals",
                "soft_delete_days",
                "noncurrent_version_days",
                "change_feed_retention_days",
                "immutability_days",
            },
        ),
    ],
    ids=["aws", "gcp", "azure"],
)
def test_input_that_can_be_wrong_is_validated(module: Path, validated: set[str]) -> None:
    variables = _variables(_parse(module))
    for name in validated:
        rule = variables[name].get("validation")
        assert rule, f"{module.name}: variable {name} has no validation"
        assert _one(rule)["error_message"].startswith(name), name


def test_examples_call_the_modules() -> None:
    for example, module in zip(EXAMPLES, MODULES, strict=True):
        calls: dict[str, Any] = {}
        for block in _parse(example)["module"]:
            calls.update(block)
        source = calls["checkpoints"]["source"]
        assert (example / source).resolve() == module.resolve()
    providers = _parse(TF / "examples" / "aws")["provider"]
    assert {p["aws"].get("alias") for p in providers} == {None, "replica"}


# -- AWS safety settings ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def aws() -> dict[str, list[Any]]:
    return _parse(AWS)


def test_aws_buckets_are_versioned_encrypted_and_private(aws) -> None:
    for bucket in ("primary", "replica"):
        versioning = _blocks(aws, "resource", "aws_s3_bucket_versioning")[bucket]
        assert _one(versioning["versioning_configuration"])["status"] == "Enabled"
        sse = _one(
            _blocks(aws, "resource", "aws_s3_bucket_server_side_encryption_configuration")[bucket][
                "rule"
            ]
        )
        default = _one(sse["apply_server_side_encryption_by_default"])
        assert default["sse_algorithm"] == "aws:kms"
        assert default["kms_master_key_id"] == f"${{aws_kms_key.{bucket}.arn}}"
        block = _blocks(aws, "resource", "aws_s3_bucket_public_access_block")[bucket]
        for flag in (
            "block_public_acls",
            "block_public_policy",
            "ignore_public_acls",
            "restrict_public_buckets",
        ):
            assert block[flag] is True, (bucket, flag)
        owner = _blocks(aws, "resource", "aws_s3_bucket_ownership_controls")[bucket]
        assert _one(owner["rule"])["object_ownership"] == "BucketOwnerEnforced"
        assert _blocks(aws, "resource", "aws_kms_key")[bucket]["enable_key_rotation"] is True
        policy = _blocks(aws, "resource", "aws_s3_bucket_policy")[bucket]["policy"]
        assert "tls_only" in policy
    # The replica side goes through the aliased provider.
    required = _one(aws["terraform"][0]["required_providers"])
    assert "${aws.replica}" in str(required["aws"]["configuration_aliases"])
    for rtype in (
        "aws_s3_bucket",
        "aws_s3_bucket_versioning",
        "aws_kms_key",
        "aws_s3_bucket_lifecycle_configuration",
    ):
        assert _blocks(aws, "resource", rtype)["replica"]["provider"] == "${aws.replica}"


def test_aws_lifecycle_aborts_uploads_and_expires_old_versions(aws) -> None:
    for bucket in ("primary", "replica"):
        rules = _blocks(aws, "resource", "aws_s3_bucket_lifecycle_configuration")[bucket]["rule"]
        whole = [r for r in rules if _one(r["filter"]) == {}]
        assert any("abort_incomplete_multipart_upload" in r for r in whole), bucket
        assert any("noncurrent_version_expiration" in r for r in rules), bucket
        assert all(r["status"] == "Enabled" for r in rules)


def test_aws_replication_handles_delete_markers_and_kms(aws) -> None:
    config = _blocks(aws, "resource", "aws_s3_bucket_replication_configuration")["primary"]
    rule = _one(config["rule"])
    assert rule["status"] == "Enabled"
    assert "replicate_deletes" in _one(rule["delete_marker_replication"])["status"]
    dest = _one(rule["destination"])
    assert dest["bucket"] == "${aws_s3_bucket.replica.arn}"
    assert _one(dest["encryption_configuration"])["replica_kms_key_id"].startswith(
        "${aws_kms_key.replica"
    )
    assert _one(_one(rule["source_selection_criteria"])["sse_kms_encrypted_objects"])["status"] == (
        "Enabled"
    )
    assert "aws_s3_bucket_versioning.replica" in str(config["depends_on"])


# -- GCP safety settings ---------------------------------------------------------------------


def test_gcp_bucket_settings() -> None:
    gcp = _parse(GCP)
    bucket = _blocks(gcp, "resource", "google_storage_bucket")["this"]
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert _one(bucket["versioning"])["enabled"] is True
    assert "ASYNC_TURBO" in bucket["rpo"]
    actions = {_one(r["action"])["type"] for r in bucket["lifecycle_rule"]}
    assert actions == {"AbortIncompleteMultipartUpload", "Delete"}
    noncurrent = [r for r in bucket["lifecycle_rule"] if _one(r["action"])["type"] == "Delete"]
    assert _one(noncurrent[0]["condition"])["with_state"] == "ARCHIVED"
    assert "transfer_spec" in _blocks(gcp, "resource", "google_storage_transfer_job")["backup"]
    member = _blocks(gcp, "resource", "google_storage_bucket_iam_member")["training"]
    assert "google_project_iam_custom_role.objckpt" in member["role"]


# -- Azure safety settings -------------------------------------------------------------------


@pytest.fixture(scope="module")
def azure() -> dict[str, list[Any]]:
    return _parse(AZURE)


def test_azure_accounts_are_private_versioned_and_soft_deleting(azure) -> None:
    for name in ("primary", "replica"):
        account = _blocks(azure, "resource", "azurerm_storage_account")[name]
        assert account["account_kind"] == "StorageV2"
        assert account["https_traffic_only_enabled"] is True
        assert account["min_tls_version"] == "TLS1_2"
        assert account["allow_nested_items_to_be_public"] is False
        assert account["shared_access_key_enabled"] == "${var.shared_access_key_enabled}"
        assert account["default_to_oauth_authentication"] is True
        assert account["is_hns_enabled"] is False
        assert account["cross_tenant_replication_enabled"] is False
        blob = _one(account["blob_properties"])
        assert blob["versioning_enabled"] is True
        assert _one(blob["delete_retention_policy"])["days"] == "${var.soft_delete_days}"
        assert _one(blob["container_delete_retention_policy"])["days"] == "${var.soft_delete_days}"
        container = _blocks(azure, "resource", "azurerm_storage_container")[name]
        assert container["container_access_type"] == "private"
    variables = _variables(azure)
    assert variables["shared_access_key_enabled"]["default"] is False
    assert variables["immutability_days"]["default"] is None  # WORM is opt-in
    primary = _blocks(azure, "resource", "azurerm_storage_account")["primary"]
    # Object replication reads the source's change feed.
    assert "local.replicated" in str(_one(primary["blob_properties"])["change_feed_enabled"])
    assert "immutability_policy" in str(primary.get("dynamic"))


def test_azure_lifecycle_deletes_old_versions_and_snapshots(azure) -> None:
    for name in ("primary", "replica"):
        policy = _blocks(azure, "resource", "azurerm_storage_management_policy")[name]
        rule = _one(policy["rule"])
        assert rule["enabled"] is True
        filters = _one(rule["filters"])
        assert filters["prefix_match"] == ["${var.container_name}/${var.run_prefix}/"]
        actions = _one(rule["actions"])
        assert "delete_after_days_since_creation" in _one(actions["version"])
        assert "delete_after_days_since_creation_greater_than" in _one(actions["snapshot"])


def test_azure_object_replication_covers_the_run_prefix(azure) -> None:
    replication = _blocks(azure, "resource", "azurerm_storage_object_replication")["backup"]
    assert "local.replicated" in replication["count"]
    assert replication["source_storage_account_id"] == "${azurerm_storage_account.primary.id}"
    assert "azurerm_storage_account.replica" in replication["destination_storage_account_id"]
    rule = _one(replication["rules"])
    assert rule["filter_out_blobs_with_prefix"] == ["${var.run_prefix}/"]


def test_azure_roles_are_scoped_to_the_container(azure) -> None:
    local = azure["locals"][0]
    for name in ("primary_scope", "replica_scope"):
        assert "/blobServices/default/containers/" in local[name], name
    roles = _blocks(azure, "resource", "azurerm_role_assignment")
    assert roles["training_primary"]["role_definition_name"] == "Storage Blob Data Contributor"
    assert roles["training_primary"]["scope"] == "${local.primary_scope}"
    assert "local.replica_scope" in roles["training_replica"]["scope"]
    # A replicated replica is read-only to clients: training only reads it.
    assert "Storage Blob Data Reader" in local["replica_training_role"]
    assert roles["reader"]["role_definition_name"] == "Storage Blob Data Reader"
    for role in roles.values():  # never an account's ID: always a container scope
        assert role["scope"].startswith("${") and "local." in role["scope"], role
        assert "azurerm_storage_account" not in role["scope"], role


# -- outputs -> the objckpt config file -----------------------------------------------------


def _render(template: str, values: dict[str, Any]) -> str:
    """The subset of terraform's template syntax the modules use: ``${name}`` and
    ``%{ if name ~}`` ... ``%{ endif ~}`` on lines of their own."""
    out: list[str] = []
    keep = [True]
    for line in template.splitlines(keepends=True):
        directive = re.fullmatch(r"%\{ (if (\w+)|endif) ~\}\n?", line)
        if directive and directive.group(2):
            keep.append(keep[-1] and bool(values[directive.group(2)]))
            continue
        if directive:
            keep.pop()
            continue
        if keep[-1]:
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: str(values[m.group(1)]), line))
    return "".join(out)


def test_aws_config_output_is_a_valid_objckpt_config() -> None:
    outputs = _outputs(_parse(AWS))
    assert {"root", "storage_options", "backups", "objckpt_config"} <= set(outputs)
    text = _render(
        (AWS / "objckpt.toml.tftpl").read_text(),
        {
            "root": "s3://llm-ckpt-eu-west-1/runs/run-1",
            "region": "eu-west-1",
            "backup_url": "s3://llm-ckpt-eu-central-1/runs/run-1",
            "backup_region": "eu-central-1",
            "backup_mode": "replicated",
            "abort_mpu_days": 2,
        },
    )
    cfg = parse_config(text, source="aws.toml", environ={})
    assert cfg.root == "s3://llm-ckpt-eu-west-1/runs/run-1"
    assert cfg.storage_options == {"client_kwargs": {"region_name": "eu-west-1"}}
    (backup,) = cfg.backups
    assert backup.mode == "replicated" and backup.url.startswith("s3://llm-ckpt-eu-central-1")
    assert backup.storage_options == {"client_kwargs": {"region_name": "eu-central-1"}}


@pytest.mark.parametrize(
    ("has_backup", "replicated"), [(False, False), (True, False), (True, True)]
)
def test_gcp_config_output_is_a_valid_objckpt_config(has_backup: bool, replicated: bool) -> None:
    text = _render(
        (GCP / "objckpt.toml.tftpl").read_text(),
        {
            "root": "gs://p-ckpt/runs/run-1",
            "project": "my-project",
            "has_backup": has_backup,
            "replicated": replicated,
            "backup_url": "gs://p-backup/runs/run-1" if has_backup else "",
            "backup_mode": "replicated" if replicated else "copy",
            "replica_timeout": 7200,
        },
    )
    cfg = parse_config(text, source="gcp.toml", environ={})
    assert cfg.root == "gs://p-ckpt/runs/run-1"
    assert len(cfg.backups) == int(has_backup)
    if replicated:
        assert cfg.backups[0].mode == "replicated" and cfg.backups[0].replica_timeout == 7200


@pytest.mark.parametrize(
    ("has_backup", "replicated"), [(False, False), (True, False), (True, True)]
)
def test_azure_config_output_is_a_valid_objckpt_config(has_backup: bool, replicated: bool) -> None:
    outputs = _outputs(_parse(AZURE))
    assert {"root", "storage_options", "backups", "objckpt_config"} <= set(outputs)
    text = _render(
        (AZURE / "objckpt.toml.tftpl").read_text(),
        {
            "root": "az://checkpoints/runs/run-1",
            "account": "llmckptp",
            "has_backup": has_backup,
            "replicated": replicated,
            "backup_url": "az://checkpoints/runs/run-1" if has_backup else "",
            "backup_account": "llmckptr" if has_backup else "",
            "backup_mode": "replicated" if replicated else "copy",
            "replica_timeout": 3600,
        },
    )
    cfg = parse_config(text, source="azure.toml", environ={})
    assert cfg.root == "az://checkpoints/runs/run-1"
    assert cfg.storage_options == {"account_name": "llmckptp", "anon": False}
    assert len(cfg.backups) == int(has_backup)
    if has_backup:
        (backup,) = cfg.backups
        assert backup.storage_options == {"account_name": "llmckptr", "anon": False}
        assert backup.mode == ("replicated" if replicated else "copy")
    if replicated:
        assert cfg.backups[0].replica_timeout == 3600


# -- IAM: exactly the actions objckpt uses ----------------------------------------------------

# S3 API operation -> the IAM actions it is authorised by (AWS's service
# authorization reference). An operation missing here fails the test: someone
# must decide which action covers it.
_IAM = {
    "HeadBucket": {"s3:ListBucket"},
    "ListObjectsV2": {"s3:ListBucket"},
    "ListObjects": {"s3:ListBucket"},
    "ListMultipartUploads": {"s3:ListBucketMultipartUploads"},
    "GetObject": {"s3:GetObject"},
    "HeadObject": {"s3:GetObject"},
    "PutObject": {"s3:PutObject"},
    "CreateMultipartUpload": {"s3:PutObject"},
    "UploadPart": {"s3:PutObject"},
    "CompleteMultipartUpload": {"s3:PutObject"},
    "CopyObject": {"s3:PutObject", "s3:GetObject"},
    "UploadPartCopy": {"s3:PutObject", "s3:GetObject"},
    "AbortMultipartUpload": {"s3:AbortMultipartUpload"},
    "ListParts": {"s3:ListMultipartUploadParts"},
    "DeleteObject": {"s3:DeleteObject"},
    "DeleteObjects": {"s3:DeleteObject"},
}


def _direct_calls() -> set[str]:
    """S3 operations objckpt names in its own code (``call("put_object", ...)``)."""
    found = set()
    for path in (REPO / "objckpt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("call", "_call_s3")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.add("".join(w.title() for w in node.args[0].value.split("_")))
    return found


def _lifecycle(proxy: FaultProxy, moto: MotoServer, tmp_path: Path) -> None:
    """Everything objckpt does to a bucket: save (small, multipart), commit, load,
    retention, backup copies (single and part copies), verify, gc of an open
    upload, delete."""
    opts = proxy.storage_options()
    client = moto.boto3_client()
    for bucket in ("iam-primary", "iam-backup"):
        client.create_bucket(Bucket=bucket)
    parts = UploadOptions(part_size=5 * 1024 * 1024)
    state = {"big": torch.arange(4 * 1024 * 1024, dtype=torch.float32), "s": torch.ones(3)}
    with CheckpointManager(
        "s3://iam-primary/run",
        storage_options=opts,
        retention=RetentionPolicy(keep_last=1),
        upload=parts,
        backups=["s3://iam-backup/run"],
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, state).result()
        mgr.wait_for_backups(timeout=120)
        got = {"big": torch.zeros_like(state["big"]), "s": torch.zeros(3)}
        mgr.load(got)
    src = Location.parse("s3://iam-primary/run", opts).child(step_name(2))
    dst = Location.parse("s3://iam-backup/parts", opts).child(step_name(2))
    # Step 2 reuses step 1's bytes: the copy goes into a step directory, with step
    # 1's 12 MiB object copied beside it (UploadPartCopy).
    copy_checkpoint(src, dst, upload=parts)
    assert verify_checkpoint(dst).ok
    # A killed save's open multipart upload, then gc aborting it.
    root = Location.parse("s3://iam-primary/run", opts)
    store = open_store(root.child(step_name(3)), parts)
    before = proxy.count("UploadPart")  # the saves above sent parts too
    upload = store.begin(payload_key(0, 0, "feedface"), 15 * 1024 * 1024)
    upload.write(bytes(15 * 1024 * 1024))
    # 15 MiB in 5 MiB parts: write() hands all three to the event loop. Wait until the
    # proxy has seen these three, then until they landed; gc takes its clock after.
    proxy.wait_for("UploadPart", count=before + 3, timeout=60)
    proxy.wait_idle(timeout=60)
    store.close()
    with CheckpointManager("s3://iam-primary/run", storage_options=opts) as mgr:
        report = mgr.gc(grace=0, dry_run=False)
        assert report.aborted_uploads
        mgr.delete(2)


def test_iam_policy_grants_exactly_the_s3_actions_objckpt_uses(
    moto_server: MotoServer, tmp_path: Path
) -> None:
    moto_server.reset()
    with FaultProxy(moto_server.endpoint_url) as proxy:
        _lifecycle(proxy, moto_server, tmp_path)
        used = proxy.operations()
    unknown = used - set(_IAM)
    assert not unknown, f"objckpt issued S3 operations with no IAM mapping: {sorted(unknown)}"
    direct = _direct_calls()
    assert direct <= used, f"calls in the code the recorded run never made: {direct - used}"
    needed = set().union(*(_IAM[op] for op in used))
    local = _parse(AWS)["locals"][0]
    granted = set(local["objckpt_bucket_actions"]) | set(local["objckpt_object_actions"])
    assert granted == needed, (
        f"terraform grants {sorted(granted - needed)} unused, lacks {sorted(needed - granted)}"
    )
