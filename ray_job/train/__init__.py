"""Training: the driver of `python -m ray_job train` (checks, Ray, the TorchTrainer, the summary),
the per-worker loop and what it is made of (the epoch in plain PyTorch, step control, the
checkpointer and its files, the run log, metrics and progress), and the stop request."""
