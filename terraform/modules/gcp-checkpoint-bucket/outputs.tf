# Each output is one entry of the objckpt config file (see README.md);
# `objckpt_config` is the whole file.

output "root" {
  description = "config: root. The run's checkpoint root URL."
  value       = "gs://${google_storage_bucket.this["primary"].name}/${var.run_prefix}/${var.run_name}"
}

output "storage_options" {
  description = "config: [storage].options. fsspec (gcsfs) options; credentials come from the service account."
  value       = { project = var.project_id }
}

output "backups" {
  description = "config: [[backups]]. Empty for a dual-region bucket (GCS keeps the second copy)."
  value = local.two_buckets ? [{
    url     = "gs://${google_storage_bucket.this["backup"].name}/${var.run_prefix}/${var.run_name}"
    mode    = var.backup_mode
    options = { project = var.project_id }
  }] : []
}

output "objckpt_config" {
  description = "The objckpt config file (TOML) for this run."
  value = templatefile("${path.module}/objckpt.toml.tftpl", {
    root        = "gs://${google_storage_bucket.this["primary"].name}/${var.run_prefix}/${var.run_name}"
    project     = var.project_id
    has_backup  = local.two_buckets
    replicated  = local.transfer
    backup_url  = local.two_buckets ? "gs://${google_storage_bucket.this["backup"].name}/${var.run_prefix}/${var.run_name}" : ""
    backup_mode = var.backup_mode
    # An hourly transfer job can take well over the default 15 minutes.
    replica_timeout = 7200
  })
}

output "custom_role_id" {
  description = "The custom role granted to the training service account."
  value       = google_project_iam_custom_role.objckpt.id
}
