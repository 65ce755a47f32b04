# Each output is one entry of the objckpt config file (see README.md);
# `objckpt_config` is the whole file, ready to write next to the training job.

output "root" {
  description = "config: root. The run's checkpoint root URL."
  value       = "s3://${aws_s3_bucket.primary.bucket}/${var.run_prefix}/${var.run_name}"
}

output "storage_options" {
  description = "config: [storage].options. fsspec (s3fs) options for the primary bucket; credentials come from the training role."
  value       = { client_kwargs = { region_name = data.aws_region.primary.name } }
}

output "backups" {
  description = "config: [[backups]]. The replica root, its mode and the options to reach it."
  value = [{
    url     = "s3://${aws_s3_bucket.replica.bucket}/${var.run_prefix}/${var.run_name}"
    mode    = var.backup_mode
    options = { client_kwargs = { region_name = data.aws_region.replica.name } }
  }]
}

output "objckpt_config" {
  description = "The objckpt config file (TOML) for this run: write it out and pass --config / OBJCKPT_CONFIG."
  value = templatefile("${path.module}/objckpt.toml.tftpl", {
    root           = "s3://${aws_s3_bucket.primary.bucket}/${var.run_prefix}/${var.run_name}"
    region         = data.aws_region.primary.name
    backup_url     = "s3://${aws_s3_bucket.replica.bucket}/${var.run_prefix}/${var.run_name}"
    backup_region  = data.aws_region.replica.name
    backup_mode    = var.backup_mode
    abort_mpu_days = var.abort_incomplete_multipart_days
  })
}

output "training_policy_arn" {
  description = "The least-privilege policy for the training role (attached when training_role_name is set)."
  value       = aws_iam_policy.training.arn
}

output "kms_key_arns" {
  description = "The buckets' KMS keys, primary and replica."
  value       = { primary = aws_kms_key.primary.arn, replica = aws_kms_key.replica.arn }
}
