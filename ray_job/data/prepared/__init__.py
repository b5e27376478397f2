"""The prepared dataset: images in uncompressed Arrow IPC files, memory-mapped by every worker.

    python -m ray_job prepare-data --from imagefolder --src ./my_jpegs --out ./prepared
    python -m ray_job train --data prepared --data-dir ./prepared --image-size 64 --stem imagenet

A prepared folder holds, per split, `<split>-00000.arrow`, ... (shards of about --shard-mb MiB,
record batches of up to BATCH_ROWS rows) and one `manifest.json`, written last: file names, sizes,
SHA-256 and row counts, the classes, the image geometry and the fingerprint of the source. No
manifest means not ready, so a half-written dataset is never used; the same source prepared again
is found by its fingerprint and left alone.

Two image layouts (the file's schema metadata says which, as does the manifest):
  raw      every image has one size: `image` is fixed_size_binary(H*W*3), uint8 HWC like CIFAR-10;
           a batch is gathered from the mapped pages with one numpy indexing operation per record
           batch and goes to the device like the in-memory split (pad-4 crop, flip, normalise there)
           when H = W = --image-size.
  encoded  sizes differ: `image` holds each file's encoded bytes (JPEG, PNG, ...), with `height` and
           `width`; decoded in the DataLoader's workers and brought to --image-size (train: random
           resized crop + flip; test: resize + center crop), uint8 out, normalised on the device.

The files are opened with `pyarrow.memory_map`: the pages are the page cache's, shared by every
worker on a node, so a worker's anonymous memory does not grow with the dataset. `--data-dir
s3://...` is staged once per node into a local cache first (`stage`), through ray_job.storage.

  format   the format's constants, manifest reading and checking, the schema
  sources  what is prepared: CIFAR-10's batches or an image folder, and its geometry
  write    shards and the manifest, written under a temporary name and swapped in
  read     PreparedImages: the memory-mapped reader the DataLoader uses; `stage`: a copy per node of a
           dataset on object storage
  cli      `python -m ray_job prepare-data`
"""

from .format import DEFAULT_SHARD_MB, MANIFEST, META_KEY, files_complete, read_manifest, sha256
from .read import PreparedImages, cache_root, open_manifest, remote_manifest, stage
from .sources import Source, cifar10_source, imagefolder_source
from .write import ensure_prepared, write_prepared

__all__ = ["DEFAULT_SHARD_MB", "MANIFEST", "META_KEY", "PreparedImages", "sha256", "Source", "cache_root",
           "cifar10_source", "ensure_prepared", "files_complete", "imagefolder_source", "open_manifest",
           "read_manifest", "remote_manifest", "stage", "write_prepared"]
