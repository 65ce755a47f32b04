output "objckpt_config" {
  description = "The objckpt config file for the run."
  value       = module.checkpoints.objckpt_config
}

output "container_scopes" {
  description = "The containers' ARM scopes, for granting further identities."
  value       = module.checkpoints.container_scopes
}
