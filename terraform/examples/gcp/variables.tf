variable "project_id" {
  type        = string
  description = "GCP project for the bucket."
}

variable "run_name" {
  type        = string
  description = "The training run the generated config points at."
  default     = "run-1"
}

variable "training_service_account" {
  type        = string
  description = "Service account email the training job runs as (null: grant nothing)."
  default     = null
}
