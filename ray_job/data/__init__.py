"""Datasets and their input pipelines: CIFAR-10, synthetic data, image folders and the prepared
format (memory-mapped Arrow shards, one copy per node), and the device-side augmentation.

  errors     DataError
  augment    DeviceAugment (crop, flip, normalise on the device)
  arrays     Split and the in-memory datasets (uint8 batches; the PIL pipeline)
  cifar10    torchvision's CIFAR-10 files
  synthetic  a learnable dataset generated in memory
  views      one image file as the model sees it (decode; the test split's resize), for predict too
  prepared/  the prepared format: format, sources, write, read (and stage), cli
  datasets   a run's datasets by --data, and the driver's check
"""
