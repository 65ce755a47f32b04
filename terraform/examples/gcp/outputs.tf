output "objckpt_config" {
  description = "The objckpt config file for the run."
  value       = module.checkpoints.objckpt_config
}
