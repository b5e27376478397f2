"""Peers: what users would run instead of ray_job, kept as baselines to measure against.

Nothing here is a product road. `raw_ddp` is the raw-DDP baseline: the hand-written DDP script
users start with torchrun or srun, so that `python -m ray_job bench vs-ddp` and `bench race` can
state every claim as a ratio against it.
"""
