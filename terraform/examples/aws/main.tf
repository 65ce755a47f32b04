# Primary bucket in eu-west-1, replica in eu-central-1, S3 replicating itself.
#   terraform init && terraform apply -var training_role_name=my-training-role
#   terraform output -raw objckpt_config > objckpt.toml

provider "aws" {
  region = var.primary_region
}

provider "aws" {
  alias  = "replica"
  region = var.replica_region
}

module "checkpoints" {
  source = "../../modules/aws-checkpoint-buckets"
  providers = {
    aws         = aws
    aws.replica = aws.replica
  }

  primary_bucket_name = "${var.name}-ckpt-${var.primary_region}"
  replica_bucket_name = "${var.name}-ckpt-${var.replica_region}"
  run_name            = var.run_name
  backup_mode         = "replicated"
  training_role_name  = var.training_role_name
  tags                = { project = var.name }
}
