"""Where a run's files live: a local folder or an object store, behind one pyarrow.fs filesystem.

`--storage-path` is a local path or a URI: `s3://BUCKET/PREFIX` (AWS S3 or any S3-compatible store:
Ceph RGW, MinIO, SeaweedFS) or another URI that `pyarrow.fs` understands (gs://, hdfs://, file://).
Everything the driver and rank 0 write or read there -- config.json, summary.json, metrics, events,
topology, TensorBoard files, checkpoints, the stop request, the scaling outputs -- goes through a
`Location` (a filesystem object and a path on it).

  faults     StorageError (one line, no credentials), retrying; the retrying filesystem handed to Ray
  location   Location, `at(path or URI)`, S3 settings from the AWS variables, strict JSON files
  check      the driver's fail-fast check (`python -m ray_job.storage check URI`)
"""

from .check import check_writable
from .faults import StorageError, faults, for_ray, reason, retrying, unwrap
from .location import CHUNK, Location, Where, at, filesystem, fs_path, read_json, read_jsonl, write_json

__all__ = ["CHUNK", "Location", "StorageError", "Where", "at", "check_writable", "faults", "filesystem",
           "for_ray", "fs_path", "read_json", "read_jsonl", "reason", "retrying", "unwrap", "write_json"]
