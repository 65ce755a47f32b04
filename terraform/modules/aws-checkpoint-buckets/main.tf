# Checkpoint buckets for objckpt: a primary and a replica in another region,
# versioned, KMS-encrypted, closed to the public, with lifecycle rules for what a
# killed save leaves behind, optional Cross-Region Replication, and the IAM
# policy a training job needs: exactly the S3 actions objckpt issues.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "primary" {}

data "aws_region" "replica" {
  provider = aws.replica
}

locals {
  replicated  = var.backup_mode == "replicated"
  prefix_glob = "${var.run_prefix}/*"

  # Every S3 action objckpt's code issues (tests/integrations/test_terraform.py derives the
  # operations from a recorded run through a proxy and checks this list).
  #   ListBucket                 ListObjectsV2 (ls, gc, retention, preflight)
  #   ListBucketMultipartUploads gc finds uploads a killed save left open
  #   GetObject                  GetObject/HeadObject (load, verify), CopyObject source
  #   PutObject                  PutObject, multipart uploads, CopyObject/UploadPartCopy target,
  #                              the preflight's write probe (an upload begun and aborted)
  #   DeleteObject               retention, gc, `objckpt rm`
  #   AbortMultipartUpload       a failed save aborts its upload; gc aborts stale ones
  #   ListMultipartUploadParts   gc dates an open upload by its newest part
  objckpt_bucket_actions = ["s3:ListBucket", "s3:ListBucketMultipartUploads"]
  objckpt_object_actions = [
    "s3:AbortMultipartUpload",
    "s3:DeleteObject",
    "s3:GetObject",
    "s3:ListMultipartUploadParts",
    "s3:PutObject",
  ]
  # A replica that S3 fills itself is only read (the replicated-mode check, and
  # loading when the primary fails).
  replica_object_actions = local.replicated ? ["s3:GetObject"] : local.objckpt_object_actions
  replica_bucket_actions = local.replicated ? ["s3:ListBucket"] : local.objckpt_bucket_actions
}

# -- encryption keys, one per region ------------------------------------------------

data "aws_iam_policy_document" "key" {
  #checkov:skip=CKV_AWS_111:A key policy's "*" resource is the key itself; the account root delegates use of the key to IAM policies (AWS's default key policy).
  #checkov:skip=CKV_AWS_356:A key policy's "*" resource is the key itself, not every resource.
  #checkov:skip=CKV_AWS_109:Key administration stays with the account (the default key policy); IAM policies grant the narrow use.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

resource "aws_kms_key" "primary" {
  description             = "objckpt checkpoints in ${var.primary_bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days
  policy                  = data.aws_iam_policy_document.key.json
  tags                    = var.tags
}

resource "aws_kms_key" "replica" {
  provider                = aws.replica
  description             = "objckpt checkpoints in ${var.replica_bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days
  policy                  = data.aws_iam_policy_document.key.json
  tags                    = var.tags
}

# -- the two buckets --------------------------------------------------------------------

resource "aws_s3_bucket" "primary" {
  #checkov:skip=CKV_AWS_18:Access logs would need a third bucket per region; CloudTrail data events are the recommended audit trail for checkpoints.
  #checkov:skip=CKV2_AWS_62:objckpt needs no event notifications; the manifest is the commit signal.
  bucket        = var.primary_bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket" "replica" {
  #checkov:skip=CKV_AWS_18:Access logs would need a third bucket per region; CloudTrail data events are the recommended audit trail for checkpoints.
  #checkov:skip=CKV2_AWS_62:objckpt needs no event notifications; the manifest is the commit signal.
  #checkov:skip=CKV_AWS_144:This is the replication destination; replicating it again would only add a third copy.
  provider      = aws.replica
  bucket        = var.replica_bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_versioning" "primary" {
  bucket = aws_s3_bucket.primary.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_versioning" "replica" {
  provider = aws.replica
  bucket   = aws_s3_bucket.replica.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "primary" {
  bucket = aws_s3_bucket.primary.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.primary.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "replica" {
  provider = aws.replica
  bucket   = aws_s3_bucket.replica.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.replica.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_public_access_block" "primary" {
  bucket                  = aws_s3_bucket.primary.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_public_access_block" "replica" {
  provider                = aws.replica
  bucket                  = aws_s3_bucket.replica.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "primary" {
  bucket = aws_s3_bucket.primary.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_ownership_controls" "replica" {
  provider = aws.replica
  bucket   = aws_s3_bucket.replica.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

# Killed saves leave open multipart uploads (billed, invisible): S3 aborts them.
# Deleted or overwritten objects stay as noncurrent versions for an undo window.
resource "aws_s3_bucket_lifecycle_configuration" "primary" {
  bucket     = aws_s3_bucket.primary.id
  depends_on = [aws_s3_bucket_versioning.primary]

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  rule {
    id     = "objckpt-noncurrent-versions"
    status = "Enabled"
    filter {
      prefix = "${var.run_prefix}/"
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }
    expiration {
      expired_object_delete_marker = true
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "replica" {
  provider   = aws.replica
  bucket     = aws_s3_bucket.replica.id
  depends_on = [aws_s3_bucket_versioning.replica]

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  rule {
    id     = "objckpt-noncurrent-versions"
    status = "Enabled"
    filter {
      prefix = "${var.run_prefix}/"
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }
    expiration {
      expired_object_delete_marker = true
    }
  }
}

# Plain HTTP is refused on both buckets.
data "aws_iam_policy_document" "tls_only" {
  for_each = {
    primary = aws_s3_bucket.primary.arn
    replica = aws_s3_bucket.replica.arn
  }
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [each.value, "${each.value}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "primary" {
  bucket     = aws_s3_bucket.primary.id
  policy     = data.aws_iam_policy_document.tls_only["primary"].json
  depends_on = [aws_s3_bucket_public_access_block.primary]
}

resource "aws_s3_bucket_policy" "replica" {
  provider   = aws.replica
  bucket     = aws_s3_bucket.replica.id
  policy     = data.aws_iam_policy_document.tls_only["replica"].json
  depends_on = [aws_s3_bucket_public_access_block.replica]
}

# -- Cross-Region Replication (backup_mode = "replicated") ---------------------------

data "aws_iam_policy_document" "replication_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "replication" {
  count              = local.replicated ? 1 : 0
  name               = "${var.primary_bucket_name}-replication"
  assume_role_policy = data.aws_iam_policy_document.replication_assume.json
  tags               = var.tags
}

data "aws_iam_policy_document" "replication" {
  statement {
    sid       = "ReadSourceConfiguration"
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [aws_s3_bucket.primary.arn]
  }
  statement {
    sid = "ReadSourceVersions"
    actions = [
      "s3:GetObjectVersionForReplication",
      "s3:GetObjectVersionAcl",
      "s3:GetObjectVersionTagging",
    ]
    resources = ["${aws_s3_bucket.primary.arn}/${local.prefix_glob}"]
  }
  statement {
    sid       = "WriteReplica"
    actions   = ["s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags"]
    resources = ["${aws_s3_bucket.replica.arn}/${local.prefix_glob}"]
  }
  statement {
    sid       = "DecryptSource"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.primary.arn]
  }
  statement {
    sid       = "EncryptReplica"
    actions   = ["kms:Encrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.replica.arn]
  }
}

resource "aws_iam_role_policy" "replication" {
  count  = local.replicated ? 1 : 0
  name   = "objckpt-replication"
  role   = aws_iam_role.replication[0].id
  policy = data.aws_iam_policy_document.replication.json
}

resource "aws_s3_bucket_replication_configuration" "primary" {
  count      = local.replicated ? 1 : 0
  bucket     = aws_s3_bucket.primary.id
  role       = aws_iam_role.replication[0].arn
  depends_on = [aws_s3_bucket_versioning.primary, aws_s3_bucket_versioning.replica]

  rule {
    id       = "objckpt-checkpoints"
    status   = "Enabled"
    priority = 1
    filter {
      prefix = "${var.run_prefix}/"
    }
    delete_marker_replication {
      status = var.replicate_deletes ? "Enabled" : "Disabled"
    }
    source_selection_criteria {
      sse_kms_encrypted_objects {
        status = "Enabled"
      }
    }
    destination {
      bucket        = aws_s3_bucket.replica.arn
      storage_class = "STANDARD"
      encryption_configuration {
        replica_kms_key_id = aws_kms_key.replica.arn
      }
      # Replication Time Control: 99.99% of objects within 15 minutes, with metrics
      # to alarm on; objckpt's replicated-mode check waits on the same objects.
      replication_time {
        status = "Enabled"
        time {
          minutes = 15
        }
      }
      metrics {
        status = "Enabled"
        event_threshold {
          minutes = 15
        }
      }
    }
  }
}

# -- the training job's policy ---------------------------------------------------------

data "aws_iam_policy_document" "training" {
  statement {
    sid       = "ListCheckpointBuckets"
    actions   = local.objckpt_bucket_actions
    resources = [aws_s3_bucket.primary.arn]
  }
  statement {
    sid       = "ReadWriteCheckpoints"
    actions   = local.objckpt_object_actions
    resources = ["${aws_s3_bucket.primary.arn}/${local.prefix_glob}"]
  }
  statement {
    sid       = "ListReplica"
    actions   = local.replica_bucket_actions
    resources = [aws_s3_bucket.replica.arn]
  }
  statement {
    sid       = "ReplicaObjects"
    actions   = local.replica_object_actions
    resources = ["${aws_s3_bucket.replica.arn}/${local.prefix_glob}"]
  }
  statement {
    sid       = "UseCheckpointKeys"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.primary.arn, aws_kms_key.replica.arn]
  }
}

resource "aws_iam_policy" "training" {
  name        = "${var.primary_bucket_name}-objckpt-training"
  description = "What objckpt needs to save, load, back up and clean checkpoints under ${var.run_prefix}/"
  policy      = data.aws_iam_policy_document.training.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "training" {
  count      = var.training_role_name == null ? 0 : 1
  role       = var.training_role_name
  policy_arn = aws_iam_policy.training.arn
}
