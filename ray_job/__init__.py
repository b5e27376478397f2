"""ray_job: ResNet on CIFAR-10 with Ray Train, on a laptop, a Ray cluster, or a SLURM allocation."""

__version__ = "0.1.0"
