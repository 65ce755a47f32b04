output "objckpt_config" {
  description = "The objckpt config file for the run."
  value       = module.checkpoints.objckpt_config
}

output "training_policy_arn" {
  description = "The policy the training role needs."
  value       = module.checkpoints.training_policy_arn
}
