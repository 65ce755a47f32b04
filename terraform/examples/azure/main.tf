# Primary account in westeurope, replica in northeurope, Azure object
# replication copying the runs; shared keys off (Entra ID only).
#   terraform init && terraform apply -var subscription_id=... \
#     -var training_principal_id=<object id of the training identity>
#   terraform output -raw objckpt_config > objckpt.toml

provider "azurerm" {
  features {}
  subscription_id = var.subscription_id
  # Shared keys are off: the provider's own data-plane calls use Entra ID too.
  storage_use_azuread = true
}

resource "azurerm_resource_group" "primary" {
  name     = "${var.name}-ckpt-${var.primary_location}"
  location = var.primary_location
}

resource "azurerm_resource_group" "replica" {
  name     = "${var.name}-ckpt-${var.replica_location}"
  location = var.replica_location
}

module "checkpoints" {
  source = "../../modules/azure-checkpoint-storage"

  resource_group_name          = azurerm_resource_group.primary.name
  location                     = var.primary_location
  storage_account_name         = "${var.name}ckpt${substr(md5(var.subscription_id), 0, 6)}p"
  replica_resource_group_name  = azurerm_resource_group.replica.name
  replica_location             = var.replica_location
  replica_storage_account_name = "${var.name}ckpt${substr(md5(var.subscription_id), 0, 6)}r"
  backup_mode                  = "replicated"
  run_name                     = var.run_name
  training_principals          = var.training_principal_id == null ? {} : { training = var.training_principal_id }
  reader_principals            = var.evaluation_principal_id == null ? {} : { evaluation = var.evaluation_principal_id }
  tags                         = { project = var.name }
}
