# Checkpoint storage for objckpt on Azure: a StorageV2 account with a private
# container (a second account in another region for backups, optional),
# versioning, blob and container soft delete, optional time-based immutability,
# lifecycle rules for old versions and snapshots, optional object replication,
# and role assignments scoped to the container: Storage Blob Data Contributor
# for training, Storage Blob Data Reader for evaluation.

locals {
  has_replica = var.replica_storage_account_name != null
  replicated  = local.has_replica && var.backup_mode == "replicated"
  restricted  = length(var.allowed_subnet_ids) + length(var.allowed_ip_ranges) > 0

  # Role assignments go on the container (ARM scope), never the account.
  primary_scope = "${azurerm_storage_account.primary.id}/blobServices/default/containers/${azurerm_storage_container.primary.name}"
  replica_scope = local.has_replica ? "${azurerm_storage_account.replica[0].id}/blobServices/default/containers/${azurerm_storage_container.replica[0].name}" : null

  # A replica that object replication fills is read-only to clients (Azure refuses
  # writes to a destination container); with objckpt copying, training writes it.
  replica_training_role = local.replicated ? "Storage Blob Data Reader" : "Storage Blob Data Contributor"

  # Every reader on every container: "primary/<name>", "replica/<name>".
  reader_scopes = {
    for pair in setproduct(concat(["primary"], local.has_replica ? ["replica"] : []), keys(var.reader_principals)) :
    "${pair[0]}/${pair[1]}" => { scope = pair[0], principal_id = var.reader_principals[pair[1]] }
  }
}

# -- the accounts -----------------------------------------------------------------------

resource "azurerm_storage_account" "primary" {
  #checkov:skip=CKV2_AZURE_1:Microsoft-managed keys with infrastructure (double) encryption; a customer-managed key needs a Key Vault with purge protection and an identity per account, which belongs to the platform's key management (azurerm_storage_account_customer_managed_key).
  #checkov:skip=CKV2_AZURE_33:Private endpoints depend on the training cluster's network; restrict with allowed_subnet_ids / allowed_ip_ranges or add an endpoint outside the module. Access is Entra ID only.
  #checkov:skip=CKV_AZURE_59:Training clusters reach the account from networks the module cannot know; allowed_subnet_ids / allowed_ip_ranges close it, and Entra ID decides every request.
  #checkov:skip=CKV_AZURE_35:The default action is Deny as soon as allowed_subnet_ids or allowed_ip_ranges name a network; open by default because the module cannot know the training cluster's.
  #checkov:skip=CKV_AZURE_33:Queue service logging: no queues are used.
  #checkov:skip=CKV_AZURE_206:Redundancy inside Azure is account_replication_type (ZRS by default); the cross-region copy objckpt checks is the replica account.
  name                     = var.storage_account_name
  resource_group_name      = var.resource_group_name
  location                 = var.location
  account_kind             = "StorageV2"
  account_tier             = "Standard"
  account_replication_type = var.account_replication_type
  access_tier              = "Hot"

  https_traffic_only_enabled        = true
  min_tls_version                   = "TLS1_2"
  allow_nested_items_to_be_public   = false
  shared_access_key_enabled         = var.shared_access_key_enabled
  default_to_oauth_authentication   = true
  local_user_enabled                = false
  sftp_enabled                      = false
  is_hns_enabled                    = false # versioning, object replication and WORM need a flat namespace
  cross_tenant_replication_enabled  = false
  infrastructure_encryption_enabled = true

  blob_properties {
    versioning_enabled            = true
    change_feed_enabled           = local.replicated # object replication reads the source's change feed
    change_feed_retention_in_days = local.replicated ? var.change_feed_retention_days : null

    delete_retention_policy {
      days = var.soft_delete_days
    }
    container_delete_retention_policy {
      days = var.soft_delete_days
    }
  }

  # Version-level WORM, off by default: see README.md for what it does to
  # objckpt's retention and gc. Unlocked: locking is irreversible, so it is a
  # deliberate step outside terraform.
  dynamic "immutability_policy" {
    for_each = var.immutability_days == null ? [] : [var.immutability_days]
    content {
      state                         = "Unlocked"
      allow_protected_append_writes = false
      period_since_creation_in_days = immutability_policy.value
    }
  }

  # A user delegation SAS (the only kind without shared keys) lives at most a day.
  sas_policy {
    expiration_period = "01.00:00:00"
    expiration_action = "Log"
  }

  network_rules {
    default_action             = local.restricted ? "Deny" : "Allow"
    bypass                     = ["AzureServices"]
    ip_rules                   = var.allowed_ip_ranges
    virtual_network_subnet_ids = var.allowed_subnet_ids
  }

  tags = var.tags
}

resource "azurerm_storage_account" "replica" {
  #checkov:skip=CKV2_AZURE_1:Microsoft-managed keys with infrastructure (double) encryption; a customer-managed key needs a Key Vault with purge protection and an identity per account, which belongs to the platform's key management (azurerm_storage_account_customer_managed_key).
  #checkov:skip=CKV2_AZURE_33:Private endpoints depend on the training cluster's network; restrict with allowed_subnet_ids / allowed_ip_ranges or add an endpoint outside the module. Access is Entra ID only.
  #checkov:skip=CKV_AZURE_59:Training clusters reach the account from networks the module cannot know; allowed_subnet_ids / allowed_ip_ranges close it, and Entra ID decides every request.
  #checkov:skip=CKV_AZURE_35:The default action is Deny as soon as allowed_subnet_ids or allowed_ip_ranges name a network; open by default because the module cannot know the training cluster's.
  #checkov:skip=CKV_AZURE_33:Queue service logging: no queues are used.
  #checkov:skip=CKV_AZURE_206:This is the cross-region copy already; geo-redundancy on it would only add a third region.
  count                    = local.has_replica ? 1 : 0
  name                     = var.replica_storage_account_name
  resource_group_name      = coalesce(var.replica_resource_group_name, var.resource_group_name)
  location                 = var.replica_location
  account_kind             = "StorageV2"
  account_tier             = "Standard"
  account_replication_type = var.account_replication_type
  access_tier              = "Hot"

  https_traffic_only_enabled        = true
  min_tls_version                   = "TLS1_2"
  allow_nested_items_to_be_public   = false
  shared_access_key_enabled         = var.shared_access_key_enabled
  default_to_oauth_authentication   = true
  local_user_enabled                = false
  sftp_enabled                      = false
  is_hns_enabled                    = false
  cross_tenant_replication_enabled  = false
  infrastructure_encryption_enabled = true

  blob_properties {
    versioning_enabled = true # object replication needs it on the destination too

    delete_retention_policy {
      days = var.soft_delete_days
    }
    container_delete_retention_policy {
      days = var.soft_delete_days
    }
  }

  sas_policy {
    expiration_period = "01.00:00:00"
    expiration_action = "Log"
  }

  network_rules {
    default_action             = local.restricted ? "Deny" : "Allow"
    bypass                     = ["AzureServices"]
    ip_rules                   = var.allowed_ip_ranges
    virtual_network_subnet_ids = var.allowed_subnet_ids
  }

  tags = var.tags

  lifecycle {
    precondition {
      condition     = var.replica_location != null && try(lower(replace(var.replica_location, " ", "")) != lower(replace(var.location, " ", "")), false)
      error_message = "replica_storage_account_name needs a replica_location different from location."
    }
  }
}

# -- the containers ---------------------------------------------------------------------

resource "azurerm_storage_container" "primary" {
  #checkov:skip=CKV2_AZURE_21:Blob read logging needs a Log Analytics workspace (azurerm_monitor_diagnostic_setting on the blob service); the platform's diagnostic settings are the recommended trail, as CloudTrail data events are on AWS.
  name                  = var.container_name
  storage_account_id    = azurerm_storage_account.primary.id
  container_access_type = "private"
}

resource "azurerm_storage_container" "replica" {
  #checkov:skip=CKV2_AZURE_21:Blob read logging needs a Log Analytics workspace (azurerm_monitor_diagnostic_setting on the blob service); the platform's diagnostic settings are the recommended trail, as CloudTrail data events are on AWS.
  count                 = local.has_replica ? 1 : 0
  name                  = var.container_name
  storage_account_id    = azurerm_storage_account.replica[0].id
  container_access_type = "private"
}

# -- lifecycle ----------------------------------------------------------------------------
# Deleted or overwritten blobs stay as previous versions (and soft-deleted ones
# for soft_delete_days): the policy deletes versions and snapshots under the run
# prefix after noncurrent_version_days. A killed save's staged blocks need no
# rule: Azure discards uncommitted blocks a week after the last Put Block or
# Put Block List on that blob name, and there is no lifecycle action for them.

resource "azurerm_storage_management_policy" "primary" {
  storage_account_id = azurerm_storage_account.primary.id

  rule {
    name    = "objckpt-old-versions"
    enabled = true
    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${var.container_name}/${var.run_prefix}/"]
    }
    actions {
      version {
        delete_after_days_since_creation = var.noncurrent_version_days
      }
      snapshot {
        delete_after_days_since_creation_greater_than = var.noncurrent_version_days
      }
    }
  }
}

resource "azurerm_storage_management_policy" "replica" {
  count              = local.has_replica ? 1 : 0
  storage_account_id = azurerm_storage_account.replica[0].id

  rule {
    name    = "objckpt-old-versions"
    enabled = true
    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${var.container_name}/${var.run_prefix}/"]
    }
    actions {
      version {
        delete_after_days_since_creation = var.noncurrent_version_days
      }
      snapshot {
        delete_after_days_since_creation_greater_than = var.noncurrent_version_days
      }
    }
  }
}

# -- object replication (backup_mode = "replicated") --------------------------------------

resource "azurerm_storage_object_replication" "backup" {
  count                          = local.replicated ? 1 : 0
  source_storage_account_id      = azurerm_storage_account.primary.id
  destination_storage_account_id = azurerm_storage_account.replica[0].id

  rules {
    source_container_name      = azurerm_storage_container.primary.name
    destination_container_name = azurerm_storage_container.replica[0].name
    # Despite its name, the blobs whose names start with these prefixes are the
    # ones replicated.
    filter_out_blobs_with_prefix = ["${var.run_prefix}/"]
    copy_blobs_created_after     = "Everything"
  }
}

# -- role assignments, on the containers ------------------------------------------------

resource "azurerm_role_assignment" "training_primary" {
  for_each             = var.training_principals
  scope                = local.primary_scope
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = each.value
  description          = "objckpt: ${each.key} saves, loads and cleans checkpoints in ${var.storage_account_name}/${var.container_name}"
}

resource "azurerm_role_assignment" "training_replica" {
  for_each             = local.has_replica ? var.training_principals : {}
  scope                = local.replica_scope
  role_definition_name = local.replica_training_role
  principal_id         = each.value
  description          = "objckpt: ${each.key} ${local.replicated ? "checks" : "writes"} backups in ${coalesce(var.replica_storage_account_name, "-")}/${var.container_name}"
}

resource "azurerm_role_assignment" "reader" {
  for_each             = local.reader_scopes
  scope                = each.value.scope == "primary" ? local.primary_scope : local.replica_scope
  role_definition_name = "Storage Blob Data Reader"
  principal_id         = each.value.principal_id
  description          = "objckpt: ${each.key} reads checkpoints"
}
