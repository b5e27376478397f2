"""`scale predict`: the communication model's projection on paper. No Ray, nothing runs.

    python -m ray_job scale predict --workers 8,16,32,64 --link ib

The single-worker step comes from --from (a sweep's scaling.json), else --step-ms, else a reference
measurement; the gradient size from --grad-mb, else --from, else the model's parameter count.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import TrainConfig
from ..core.errors import UsageError
from . import commmodel
from .common import ScaleOptions, saved_profile

# Single-worker speed used when no --from / --step-ms is given: seconds per image, measured on the
# GPU machine (one H200, bf16, channels_last, no Ray; /work/shared/device/README.md).
REFERENCE_S_PER_IMAGE = {
    ("resnet50", "cifar"): (1 / 15557, "ResNet-50 CIFAR stem on one H200, bf16 channels_last, batch "
                            "512: 15,557 img/s (measured 2026-11-30)"),
    ("resnet50", "imagenet"): (1 / 117665, "ResNet-50 ImageNet stem on one H200, bf16 channels_last, "
                               "batch 2048: 117,665 img/s (measured 2026-11-30)"),
}


def paper_profile(opts: ScaleOptions, cfg: TrainConfig,
                  previous: Optional[dict]) -> commmodel.StepProfile:
    """The single-worker step: --from's sweep, else flags, else a reference measurement."""
    if previous is not None and opts.step_ms is None:
        profile = saved_profile(previous)
    else:
        step_s, source = reference_step_s(opts, cfg)
        optim = (opts.optim_ms or 0.0) / 1e3
        if not 0 <= optim < step_s:
            raise UsageError("--optim-ms must be below the step time")
        profile = commmodel.StepProfile(batch=cfg.batch_size, data_s=0.0, fwd_bwd_s=step_s - optim,
                                        optim_s=optim, grad_bytes=0, source=source)
    nbytes, what = gradient_bytes(opts, cfg, previous, profile)
    return dataclasses.replace(profile, grad_bytes=int(nbytes), bucket_bytes=cfg.ddp_bucket_mb * 2**20,
                               source=f"{profile.source}; gradients {nbytes / 1e6:.1f} MB ({what})")


def gradient_bytes(opts: ScaleOptions, cfg: TrainConfig, previous: Optional[dict],
                   profile: commmodel.StepProfile) -> tuple[float, str]:
    """Bytes all-reduced per step, and where the number comes from."""
    bf16 = cfg.grad_compression == "bf16"
    if opts.grad_mb is not None:
        return opts.grad_mb * 1e6, "--grad-mb"
    if previous is not None:  # the sweep's bytes, re-halved if --grad-compression differs
        saved_bf16 = previous["config"].get("grad_compression") == "bf16"
        nbytes = profile.grad_bytes * (2 if saved_bf16 else 1) * (0.5 if bf16 else 1)
        return nbytes, f"the sweep's model, {'bf16' if bf16 else 'fp32'}"
    from ..model.resnet import build_model, gradient_bytes as model_gradient_bytes

    nbytes = model_gradient_bytes(build_model(cfg.model, cfg.stem, 10)) * (0.5 if bf16 else 1.0)
    return nbytes, f"{cfg.model} fp32{' -> bf16' if bf16 else ''}"


def reference_step_s(opts: ScaleOptions, cfg: TrainConfig) -> tuple[float, str]:
    if opts.step_ms is not None:
        if opts.step_ms <= 0:
            raise UsageError("--step-ms must be positive")
        return opts.step_ms / 1e3, f"--step-ms {opts.step_ms:g} at batch {cfg.batch_size}"
    ref = REFERENCE_S_PER_IMAGE.get((cfg.model, cfg.stem))
    if ref is None:
        raise UsageError(f"no reference step time for {cfg.model}/{cfg.stem} stem: give --step-ms "
                         f"(one worker's step at --batch-size) or --from a sweep's scaling.json")
    return ref[0] * cfg.batch_size, f"reference: {ref[1]}, i.e. {ref[0] * cfg.batch_size * 1e3:.2f} " \
                                    f"ms at batch {cfg.batch_size}"


def print_projection(opts: ScaleOptions, cfg: TrainConfig, link: commmodel.Link,
                     previous: Optional[dict]) -> int:
    profile = paper_profile(opts, cfg, previous)
    print(f"projection on {link.name}: {link.bandwidth_gbps:g} Gbit/s, {link.latency_us:g} us per "
          f"ring step ({link.note})\nsingle worker: {profile.source}\n"
          f"+overlap: backward hides up to {commmodel.BACKWARD_FRACTION:.2f} of forward+backward")
    head = (f"{'mode':>6} {'N':>5} {'batch/worker':>12} {'all-reduce ms':>13} {'step ms':>9} "
            f"{'+overlap':>9} {'efficiency':>10} {'+overlap':>9}")
    print(head + "\n" + "-" * len(head))
    for mode in opts.modes:
        for n in opts.counts:
            plain = commmodel.predict(profile, link, n, mode, cfg.batch_size, overlap=False)
            over = commmodel.predict(profile, link, n, mode, cfg.batch_size, overlap=True)
            if plain is None or over is None:
                print(f"{mode:>6} {n:>5} {'< 1 image per worker: global --batch-size too small':>50}")
                continue
            print(f"{mode:>6} {n:>5} {plain.per_worker_batch:>12} {plain.comm_s * 1e3:>13.2f} "
                  f"{plain.step_s * 1e3:>9.2f} {over.step_s * 1e3:>9.2f} {plain.efficiency:>10.2f} "
                  f"{over.efficiency:>9.2f}")
    return 0
