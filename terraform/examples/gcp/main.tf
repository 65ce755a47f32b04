# One dual-region bucket (us-central1 + us-east1) with turbo replication.
#   terraform init && terraform apply -var project_id=my-project \
#     -var training_service_account=trainer@my-project.iam.gserviceaccount.com
#   terraform output -raw objckpt_config > objckpt.toml

provider "google" {
  project = var.project_id
}

module "checkpoints" {
  source = "../../modules/gcp-checkpoint-bucket"

  project_id               = var.project_id
  bucket_name              = "${var.project_id}-ckpt"
  topology                 = "dual-region"
  location                 = "US"
  data_locations           = ["US-CENTRAL1", "US-EAST1"]
  run_name                 = var.run_name
  training_service_account = var.training_service_account
  labels                   = { app = "objckpt" }
}
