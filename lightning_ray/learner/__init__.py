"""The learner: the ranks that update the policy (Ray Train + DeepSpeed), the trainer's side of them, and a run's
checkpoints."""
