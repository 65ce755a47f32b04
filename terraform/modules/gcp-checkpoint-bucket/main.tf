# Checkpoint storage for objckpt on GCS: a dual-region bucket with turbo
# replication, or two regional buckets (objckpt copies, or a transfer job does),
# uniform bucket-level access, public access prevented, lifecycle rules, and a
# custom role holding exactly the permissions objckpt's calls need.

locals {
  two_buckets = var.topology == "two-buckets"
  transfer    = local.two_buckets && var.backup_mode == "replicated"
  buckets     = local.two_buckets ? { primary = var.bucket_name, backup = var.backup_bucket_name } : { primary = var.bucket_name }

  # gcsfs calls behind objckpt: buckets.get (preflight), objects.list (ls, gc,
  # retention), objects.get (load, verify, rewrite source), objects.create
  # (uploads, rewrite target, the create-only manifest), objects.delete
  # (retention, gc, rm).
  objckpt_permissions = [
    "storage.buckets.get",
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]
}

resource "google_storage_bucket" "this" {
  #checkov:skip=CKV_GCP_62:Access logs would need another bucket; Cloud Audit Logs data access logs are the recommended trail.
  for_each = local.buckets

  project       = var.project_id
  name          = each.value
  location      = each.key == "backup" ? var.backup_location : var.location
  force_destroy = var.force_destroy
  labels        = var.labels

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # Turbo replication: a 15-minute RPO between the two data locations.
  rpo = local.two_buckets ? null : "ASYNC_TURBO"

  dynamic "custom_placement_config" {
    for_each = local.two_buckets ? [] : [var.data_locations]
    content {
      data_locations = custom_placement_config.value
    }
  }

  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle {
    precondition {
      condition     = !local.two_buckets || (var.backup_bucket_name != null && var.backup_location != null && try(upper(var.backup_location) != upper(var.location), false))
      error_message = "topology = \"two-buckets\" needs backup_bucket_name and a backup_location different from location."
    }
  }
}

resource "google_project_iam_custom_role" "objckpt" {
  project     = var.project_id
  role_id     = "objckpt_${replace(var.bucket_name, "/[^a-zA-Z0-9_]/", "_")}"
  title       = "objckpt checkpoints in ${var.bucket_name}"
  description = "Exactly what objckpt needs to save, load, back up and clean checkpoints."
  permissions = local.objckpt_permissions
}

resource "google_storage_bucket_iam_member" "training" {
  for_each = var.training_service_account == null ? {} : local.buckets

  bucket = google_storage_bucket.this[each.key].name
  role   = google_project_iam_custom_role.objckpt.name
  member = "serviceAccount:${var.training_service_account}"
}

# -- two-buckets with backup_mode = "replicated": an hourly transfer job ---------------

data "google_storage_transfer_project_service_account" "this" {
  count   = local.transfer ? 1 : 0
  project = var.project_id
}

resource "google_storage_bucket_iam_member" "transfer_reads_primary" {
  count  = local.transfer ? 1 : 0
  bucket = google_storage_bucket.this["primary"].name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${data.google_storage_transfer_project_service_account.this[0].email}"
}

resource "google_storage_bucket_iam_member" "transfer_writes_backup" {
  count  = local.transfer ? 1 : 0
  bucket = google_storage_bucket.this["backup"].name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${data.google_storage_transfer_project_service_account.this[0].email}"
}

resource "google_storage_transfer_job" "backup" {
  count       = local.transfer ? 1 : 0
  project     = var.project_id
  description = "objckpt: copy ${var.run_prefix}/ from ${var.bucket_name} to ${coalesce(var.backup_bucket_name, "-")}"

  transfer_spec {
    gcs_data_source {
      bucket_name = google_storage_bucket.this["primary"].name
      path        = "${var.run_prefix}/"
    }
    gcs_data_sink {
      bucket_name = google_storage_bucket.this["backup"].name
      path        = "${var.run_prefix}/"
    }
    transfer_options {
      # Deletions on the primary (retention) are not mirrored: the backup keeps
      # steps until its own lifecycle or objckpt's retention removes them.
      delete_objects_unique_in_sink = false
      overwrite_when                = "DIFFERENT"
    }
  }

  schedule {
    schedule_start_date {
      year  = 2026
      month = 1
      day   = 1
    }
    repeat_interval = "3600s"
  }

  depends_on = [
    google_storage_bucket_iam_member.transfer_reads_primary,
    google_storage_bucket_iam_member.transfer_writes_backup,
  ]
}
