variable "resource_group_name" {
  type        = string
  description = "Existing resource group of the primary storage account."
}

variable "location" {
  type        = string
  description = "Azure region of the primary storage account (where training writes), e.g. \"westeurope\"."
}

variable "storage_account_name" {
  type        = string
  description = "Name of the primary storage account (globally unique)."

  validation {
    condition     = can(regex("^[a-z0-9]{3,24}$", var.storage_account_name))
    error_message = "storage_account_name must be a valid storage account name: 3-24 characters of a-z and 0-9."
  }
}

variable "container_name" {
  type        = string
  description = "Container for checkpoints in each account (the first path segment of the az:// URL)."
  default     = "checkpoints"

  validation {
    condition     = can(regex("^[a-z0-9](-?[a-z0-9])*$", var.container_name)) && length(var.container_name) >= 3 && length(var.container_name) <= 63
    error_message = "container_name must be a valid container name: 3-63 characters of a-z, 0-9 and single '-', starting and ending with a letter or digit."
  }
}

variable "account_replication_type" {
  type        = string
  description = "Redundancy of each account inside Azure: \"LRS\", \"ZRS\" (default: three zones of the region), \"GRS\", \"RAGRS\", \"GZRS\" or \"RAGZRS\". The cross-region backup objckpt knows about is the replica account, not GRS."
  default     = "ZRS"

  validation {
    condition     = contains(["LRS", "ZRS", "GRS", "RAGRS", "GZRS", "RAGZRS"], var.account_replication_type)
    error_message = "account_replication_type must be one of LRS, ZRS, GRS, RAGRS, GZRS, RAGZRS."
  }
}

variable "replica_storage_account_name" {
  type        = string
  description = "Name of the backup storage account in replica_location; null creates no replica and the config has no [[backups]]."
  default     = null

  validation {
    condition     = var.replica_storage_account_name == null || can(regex("^[a-z0-9]{3,24}$", coalesce(var.replica_storage_account_name, "x")))
    error_message = "replica_storage_account_name must be a valid storage account name: 3-24 characters of a-z and 0-9."
  }
}

variable "replica_location" {
  type        = string
  description = "Azure region of the replica account (different from location)."
  default     = null
}

variable "replica_resource_group_name" {
  type        = string
  description = "Existing resource group of the replica account; null uses resource_group_name."
  default     = null
}

variable "backup_mode" {
  type        = string
  description = "With a replica: \"replicated\": Azure object replication copies every blob under run_prefix and objckpt only checks the replica; \"copy\": no object replication, objckpt copies each committed step itself."
  default     = "replicated"

  validation {
    condition     = contains(["replicated", "copy"], var.backup_mode)
    error_message = "backup_mode must be \"replicated\" or \"copy\"."
  }
}

variable "run_prefix" {
  type        = string
  description = "Blob name prefix under which runs keep their checkpoints (the objckpt root is az://<container>/<run_prefix>/<run>)."
  default     = "runs"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*[A-Za-z0-9]$", var.run_prefix)) && !can(regex("//", var.run_prefix))
    error_message = "run_prefix must be a non-empty blob name prefix without leading or trailing '/' and without '//'."
  }
}

variable "run_name" {
  type        = string
  description = "The training run whose root the outputs name (az://<container>/<run_prefix>/<run_name>)."
  default     = "run-1"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*$", var.run_name))
    error_message = "run_name must be one path segment of letters, digits, '.', '_' and '-'."
  }
}

variable "training_principals" {
  type        = map(string)
  description = "Entra ID object IDs (principal IDs) of the training identities, by a name you choose: each gets Storage Blob Data Contributor on the checkpoint container (not the account), and on the replica container Reader (replicated) or Contributor (copy). Keys must be known at plan time."
  default     = {}

  validation {
    condition     = alltrue([for id in values(var.training_principals) : can(regex("^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$", id))])
    error_message = "training_principals must map names to object IDs (GUIDs)."
  }
}

variable "reader_principals" {
  type        = map(string)
  description = "Entra ID object IDs of read-only identities (evaluation jobs), by name: each gets Storage Blob Data Reader on the checkpoint container(s)."
  default     = {}

  validation {
    condition     = alltrue([for id in values(var.reader_principals) : can(regex("^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$", id))])
    error_message = "reader_principals must map names to object IDs (GUIDs)."
  }
}

variable "shared_access_key_enabled" {
  type        = bool
  description = "Allow the accounts' shared keys (and account SAS signed with them). false (default): Entra ID only, so the role assignments are the whole of who may do what; the azurerm provider then needs storage_use_azuread = true."
  default     = false
}

variable "soft_delete_days" {
  type        = number
  description = "Days a deleted blob, blob version or container stays restorable (blob and container soft delete)."
  default     = 7

  validation {
    condition     = var.soft_delete_days >= 1 && var.soft_delete_days <= 365 && floor(var.soft_delete_days) == var.soft_delete_days
    error_message = "soft_delete_days must be a whole number of days from 1 to 365 (Azure's limits)."
  }
}

variable "noncurrent_version_days" {
  type        = number
  description = "Days after which the lifecycle policy deletes previous blob versions and snapshots under run_prefix (counted from the version's creation; soft delete then keeps them soft_delete_days more)."
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days must be a whole number of days >= 1."
  }
}

variable "change_feed_retention_days" {
  type        = number
  description = "With backup_mode = \"replicated\": days the primary keeps its change feed (object replication reads it)."
  default     = 7

  validation {
    condition     = var.change_feed_retention_days >= 1 && var.change_feed_retention_days <= 146000 && floor(var.change_feed_retention_days) == var.change_feed_retention_days
    error_message = "change_feed_retention_days must be a whole number of days from 1 to 146000."
  }
}

variable "immutability_days" {
  type        = number
  description = "Off (null) by default. Days of a version-level time-based retention (WORM) policy on the primary account, in the Unlocked state: blobs can be written but not changed or deleted for that long, so objckpt's retention and gc cannot free space before it ends. Only on a new account (changing it recreates the account)."
  default     = null

  validation {
    condition     = var.immutability_days == null || try(var.immutability_days >= 1 && var.immutability_days <= 146000 && floor(var.immutability_days) == var.immutability_days, false)
    error_message = "immutability_days must be null or a whole number of days from 1 to 146000."
  }
}

variable "allowed_subnet_ids" {
  type        = list(string)
  description = "Subnets allowed to reach the accounts. With this and allowed_ip_ranges both empty, every network may try (Entra ID still decides); otherwise all others are denied."
  default     = []
}

variable "allowed_ip_ranges" {
  type        = list(string)
  description = "Public IPv4 addresses or CIDR ranges allowed to reach the accounts (see allowed_subnet_ids)."
  default     = []
}

variable "tags" {
  type        = map(string)
  description = "Tags for every resource the module creates."
  default     = {}
}
