"""Ray cluster facts that Python, bash (slurm_ray_start.sh) and YAML (cluster.yaml) share, each
decided once here and asked for through `python -m ray_job.cluster COMMAND`:

  ports      one node's port block: its layout (offsets) and finding a free block
  rayenv     Ray's environment defaults for every process of a job, and the auth token
  slurm      what SLURM gave the job (Allocation), its nodes and their addresses
  raypriv    the private Ray APIs the project uses, behind one door, with the Ray version they fit
  readiness  is the cluster up: alive nodes and GPUs, and the bounded wait for all of them
  node       one Ray node's `ray start --block`, as a SLURM step or a cluster.yaml command
"""
