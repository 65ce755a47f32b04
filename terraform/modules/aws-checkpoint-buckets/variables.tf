variable "primary_bucket_name" {
  type        = string
  description = "Name of the bucket training jobs write checkpoints to (in the default provider's region)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.primary_bucket_name)) && !can(regex("\\.\\.", var.primary_bucket_name))
    error_message = "primary_bucket_name must be a valid S3 bucket name: 3-63 characters of a-z, 0-9, '.' and '-', starting and ending with a letter or digit."
  }
}

variable "replica_bucket_name" {
  type        = string
  description = "Name of the backup bucket in the replica provider's region."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.replica_bucket_name)) && !can(regex("\\.\\.", var.replica_bucket_name))
    error_message = "replica_bucket_name must be a valid S3 bucket name: 3-63 characters of a-z, 0-9, '.' and '-', starting and ending with a letter or digit."
  }
}

variable "run_prefix" {
  type        = string
  description = "Key prefix under which runs keep their checkpoints (the objckpt root is s3://<bucket>/<run_prefix>/<run>)."
  default     = "runs"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*[A-Za-z0-9]$", var.run_prefix)) && !can(regex("//", var.run_prefix))
    error_message = "run_prefix must be a non-empty key prefix without leading or trailing '/' and without '//'."
  }
}

variable "run_name" {
  type        = string
  description = "The training run whose root the outputs name (s3://<bucket>/<run_prefix>/<run_name>)."
  default     = "run-1"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*$", var.run_name))
    error_message = "run_name must be one path segment of letters, digits, '.', '_' and '-'."
  }
}

variable "backup_mode" {
  type        = string
  description = "\"replicated\": S3 Cross-Region Replication copies every object and objckpt only checks the replica; \"copy\": no CRR, objckpt copies each committed step itself."
  default     = "replicated"

  validation {
    condition     = contains(["replicated", "copy"], var.backup_mode)
    error_message = "backup_mode must be \"replicated\" or \"copy\"."
  }
}

variable "training_role_name" {
  type        = string
  description = "IAM role of the training job to attach the least-privilege checkpoint policy to; null creates the policy without attaching it."
  default     = null
}

variable "abort_incomplete_multipart_days" {
  type        = number
  description = "Days after which S3 aborts a multipart upload left open (a killed save). Keep it above the longest save."
  default     = 2

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a whole number of days >= 1."
  }
}

variable "noncurrent_version_days" {
  type        = number
  description = "Days a deleted or overwritten checkpoint object is kept as a noncurrent version before it expires (the undo window for retention and `objckpt rm`)."
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days must be a whole number of days >= 1."
  }
}

variable "kms_deletion_window_days" {
  type        = number
  description = "Waiting period before a scheduled deletion of the buckets' KMS keys takes effect."
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30 (AWS's limits)."
  }
}

variable "force_destroy" {
  type        = bool
  description = "Let `terraform destroy` delete buckets that still hold checkpoints. Leave false outside experiments."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags for every resource the module creates."
  default     = {}
}

variable "replicate_deletes" {
  type        = bool
  description = "With backup_mode = \"replicated\": replicate delete markers, so retention and `objckpt rm` on the primary also hide the step on the replica (its versions stay for noncurrent_version_days). false keeps every replicated step on the replica until its own lifecycle removes it."
  default     = true
}
