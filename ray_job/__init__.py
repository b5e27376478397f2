"""ray_job: ResNet on CIFAR-10 with Ray Train, on a laptop, a Ray cluster, or a SLURM allocation.

The packages, lowest layer first; a module imports only from its own package and the layers
below it (tests/test_layers.py reads every import and fails on a cycle or an import upward):

  core      errors, exit codes, strict JSON, paths, flags from dataclasses (no Ray, no torch)
  storage   where run files live: a local folder or object storage, behind one filesystem
  cluster   Ray cluster facts for Python, bash and YAML: ports, env, token, SLURM, readiness,
            the private Ray APIs
  config    the one typed run configuration and the `train` flags
  data      datasets and input pipelines (CIFAR-10, synthetic, image folders, the prepared format)
  model     any torchvision classifier or the user's own, --init-weights, optimizer, LR schedule
  tracking  experiment tracking (MLflow)
  train     the driver, the per-worker loop, the checkpointer, step control, the run log
  scale     the scaling sweep
  tune      hyperparameter search with Ray Tune
  infer     the trained model afterwards: export (torch.export) and predict (Ray Data)
  peers     the raw-DDP baseline (what users would run instead)
  bench     benchmarks
  commands  `python -m ray_job COMMAND`, and the SLURM script's plan
"""

__version__ = "0.3.0"

LAYERS = ("core", "storage", "cluster", "config", "data", "model", "tracking", "train", "scale", "tune",
          "infer", "peers", "bench", "commands")
