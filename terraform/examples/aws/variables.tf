variable "name" {
  type        = string
  description = "Short project name; the buckets are <name>-ckpt-<region>."
  default     = "llm"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters of a-z, 0-9 and '-'."
  }
}

variable "primary_region" {
  type        = string
  description = "Region of the primary bucket (where training runs)."
  default     = "eu-west-1"
}

variable "replica_region" {
  type        = string
  description = "Region of the replica bucket."
  default     = "eu-central-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.replica_region))
    error_message = "replica_region must be an AWS region name such as eu-central-1."
  }
}

variable "run_name" {
  type        = string
  description = "The training run the generated config points at."
  default     = "run-1"
}

variable "training_role_name" {
  type        = string
  description = "IAM role the training job runs as (null: create the policy only)."
  default     = null
}
