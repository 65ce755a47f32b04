variable "project_id" {
  type        = string
  description = "Project that owns the buckets and the custom IAM role."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project ID: 6-30 characters of a-z, 0-9 and '-', starting with a letter."
  }
}

variable "bucket_name" {
  type        = string
  description = "Name of the checkpoint bucket (with topology = \"two-buckets\", the primary one)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_.-]{1,61}[a-z0-9]$", var.bucket_name)) && !startswith(var.bucket_name, "goog")
    error_message = "bucket_name must be a valid GCS bucket name: 3-63 characters of a-z, 0-9, '-', '_' and '.', not starting with \"goog\"."
  }
}

variable "topology" {
  type        = string
  description = "\"dual-region\": one bucket whose objects GCS stores in two regions with turbo replication (15-minute RPO), so no objckpt backup is needed; \"two-buckets\": a primary and a backup bucket in separate regions, backed up by objckpt (backup_mode = \"copy\") or a Storage Transfer job (\"replicated\")."
  default     = "dual-region"

  validation {
    condition     = contains(["dual-region", "two-buckets"], var.topology)
    error_message = "topology must be \"dual-region\" or \"two-buckets\"."
  }
}

variable "location" {
  type        = string
  description = "dual-region: the multi-region that contains data_locations (\"US\", \"EU\", \"ASIA\"); two-buckets: the primary bucket's region."
  default     = "US"
}

variable "data_locations" {
  type        = list(string)
  description = "dual-region: the two regions the bucket's data is kept in (e.g. [\"US-CENTRAL1\", \"US-EAST1\"])."
  default     = ["US-CENTRAL1", "US-EAST1"]

  validation {
    condition     = length(var.data_locations) == 2 && length(distinct([for l in var.data_locations : upper(l)])) == 2
    error_message = "data_locations must name exactly two different regions."
  }
}

variable "backup_bucket_name" {
  type        = string
  description = "two-buckets: name of the backup bucket."
  default     = null

  validation {
    condition     = var.backup_bucket_name == null || can(regex("^[a-z0-9][a-z0-9_.-]{1,61}[a-z0-9]$", coalesce(var.backup_bucket_name, "x")))
    error_message = "backup_bucket_name must be a valid GCS bucket name."
  }
}

variable "backup_location" {
  type        = string
  description = "two-buckets: the backup bucket's region (different from location)."
  default     = null
}

variable "backup_mode" {
  type        = string
  description = "two-buckets: \"copy\" (objckpt copies each committed step with a GCS rewrite) or \"replicated\" (an hourly Storage Transfer job copies; objckpt only checks)."
  default     = "copy"

  validation {
    condition     = contains(["copy", "replicated"], var.backup_mode)
    error_message = "backup_mode must be \"copy\" or \"replicated\"."
  }
}

variable "run_prefix" {
  type        = string
  description = "Object prefix under which runs keep their checkpoints."
  default     = "runs"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*[A-Za-z0-9]$", var.run_prefix)) && !can(regex("//", var.run_prefix))
    error_message = "run_prefix must be a non-empty prefix without leading or trailing '/' and without '//'."
  }
}

variable "run_name" {
  type        = string
  description = "The training run whose root the outputs name (gs://<bucket>/<run_prefix>/<run_name>)."
  default     = "run-1"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*$", var.run_name))
    error_message = "run_name must be one path segment of letters, digits, '.', '_' and '-'."
  }
}

variable "training_service_account" {
  type        = string
  description = "Email of the training job's service account, granted the objckpt role on the bucket(s); null grants nothing."
  default     = null

  validation {
    condition     = var.training_service_account == null || can(regex("^[^@\\s]+@[^@\\s]+\\.iam\\.gserviceaccount\\.com$", coalesce(var.training_service_account, "x@y.iam.gserviceaccount.com")))
    error_message = "training_service_account must be a service account email (...@....iam.gserviceaccount.com)."
  }
}

variable "abort_incomplete_multipart_days" {
  type        = number
  description = "Days after which GCS aborts an XML-API multipart upload left open."
  default     = 2

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a whole number of days >= 1."
  }
}

variable "noncurrent_version_days" {
  type        = number
  description = "Days a deleted or overwritten object is kept as a noncurrent version (the undo window)."
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days must be a whole number of days >= 1."
  }
}

variable "force_destroy" {
  type        = bool
  description = "Let `terraform destroy` delete buckets that still hold checkpoints."
  default     = false
}

variable "labels" {
  type        = map(string)
  description = "Labels for the buckets."
  default     = {}
}
