# Each output is one entry of the objckpt config file (see README.md);
# `objckpt_config` is the whole file, ready to write next to the training job.

output "root" {
  description = "config: root. The run's checkpoint root URL."
  value       = "az://${azurerm_storage_container.primary.name}/${var.run_prefix}/${var.run_name}"
}

output "storage_options" {
  description = "config: [storage].options. adlfs options for the primary account; credentials come from the training identity (anon = false: azure-identity's default chain)."
  value       = { account_name = azurerm_storage_account.primary.name, anon = false }
}

output "backups" {
  description = "config: [[backups]]. The replica root, its mode and the options to reach it; empty without a replica account."
  value = local.has_replica ? [{
    url     = "az://${azurerm_storage_container.replica[0].name}/${var.run_prefix}/${var.run_name}"
    mode    = var.backup_mode
    options = { account_name = azurerm_storage_account.replica[0].name, anon = false }
  }] : []
}

output "objckpt_config" {
  description = "The objckpt config file (TOML) for this run: write it out and pass --config / OBJCKPT_CONFIG."
  value = templatefile("${path.module}/objckpt.toml.tftpl", {
    root           = "az://${azurerm_storage_container.primary.name}/${var.run_prefix}/${var.run_name}"
    account        = azurerm_storage_account.primary.name
    has_backup     = local.has_replica
    replicated     = local.replicated
    backup_url     = local.has_replica ? "az://${azurerm_storage_container.replica[0].name}/${var.run_prefix}/${var.run_name}" : ""
    backup_account = local.has_replica ? azurerm_storage_account.replica[0].name : ""
    backup_mode    = var.backup_mode
    # Object replication is asynchronous with no time guarantee: wait up to an hour.
    replica_timeout = 3600
  })
}

output "storage_account_ids" {
  description = "The storage accounts' resource IDs, primary and (when created) replica."
  value = {
    for name, id in {
      primary = azurerm_storage_account.primary.id
      replica = local.has_replica ? azurerm_storage_account.replica[0].id : null
    } : name => id if id != null
  }
}

output "container_scopes" {
  description = "The containers' ARM scopes the role assignments use, for granting further identities elsewhere."
  value = {
    for name, scope in { primary = local.primary_scope, replica = local.replica_scope } :
    name => scope if scope != null
  }
}
