"""Peers: what users would run instead of ray_job, kept as baselines to measure against.

Nothing here is a product road. `seed_ddp` is the seed's raw-DDP script (torchrun / srun), so that
`python -m ray_job bench --vs-ddp` can state every claim as a ratio against it.
"""
