variable "subscription_id" {
  type        = string
  description = "Azure subscription for the resource groups and accounts."
}

variable "name" {
  type        = string
  description = "Short project name; the accounts are <name>ckpt<hash>p and <name>ckpt<hash>r."
  default     = "llm"

  validation {
    condition     = can(regex("^[a-z0-9]{2,13}$", var.name))
    error_message = "name must be 2-13 characters of a-z and 0-9 (storage account names allow no '-')."
  }
}

variable "primary_location" {
  type        = string
  description = "Region of the primary account (where training runs)."
  default     = "westeurope"
}

variable "replica_location" {
  type        = string
  description = "Region of the replica account."
  default     = "northeurope"
}

variable "run_name" {
  type        = string
  description = "The training run the generated config points at."
  default     = "run-1"
}

variable "training_principal_id" {
  type        = string
  description = "Object ID of the identity the training job runs as (null: assign no role)."
  default     = null
}

variable "evaluation_principal_id" {
  type        = string
  description = "Object ID of a read-only identity for evaluation jobs (null: none)."
  default     = null
}
