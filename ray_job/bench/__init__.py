"""`python -m ray_job bench COMMAND`: measurements that print figures (never assertions).

    bench step        images/s of the raw-DDP baseline's pipeline vs this project's step, with and
                      without Ray, and each as a share of the device's peak (step.py)
    bench data-path   the input pipeline alone: in-memory vs prepared vs JPEG, img/s and memory
                      (datapath.py)
    bench vs-ddp      torchrun vs Ray Train, the baseline's loop vs ours (vsddp.py)
    bench race        time to accuracy: the baseline's recipe vs `train --recipe fast` (race.py)
    bench checkpoints the cost of checkpoints: steady img/s and the stall per checkpoint, none vs
                      synchronous vs asynchronous, local folder and object storage (checkpoints.py)
    bench tracking    the cost of --mlflow: the tracking calls of a run's start, of each epoch and
                      of its end, timed against a store (tracking.py)
    bench memory      --strategy ddp vs fsdp vs hsdp: bytes of parameters, gradients and optimizer
                      state per worker, peak memory and images/s, with and without activation
                      checkpointing (memory.py)

Each writes its report as strict JSON (--out) beside what it prints. The parts share common.py
(device, timed steps, launchers, the device's peak FLOP/s).
"""

from __future__ import annotations

import importlib
import os

from ..core.errors import UsageError

# command (its module: the command without "-") -> its config class
COMMANDS = {
    "step": "StepConfig",
    "data-path": "DataPathConfig",
    "vs-ddp": "VsDdpConfig",
    "race": "RaceConfig",
    "checkpoints": "CheckpointBenchConfig",
    "tracking": "TrackingBenchConfig",
    "memory": "MemoryBenchConfig",
}


def main(argv: list[str]) -> int:
    from ..core.flags import ArgumentParser, Formatter, add_dataclass_args
    from ..core.paths import resolve_path
    from ..storage import write_json

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1])
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        raise UsageError(f"unknown bench command {argv[0]!r}; use one of {', '.join(COMMANDS)}")
    module = importlib.import_module(f"{__name__}.{argv[0].replace('-', '')}")
    cls = getattr(module, COMMANDS[argv[0]])
    parser = ArgumentParser(prog=f"python -m ray_job bench {argv[0]}", formatter_class=Formatter,
                            description=(module.__doc__ or "").split("\n\n")[0])
    add_dataclass_args(parser, cls)
    args = vars(parser.parse_args(argv[1:]))
    cfg = cls(**{k: resolve_path(v) if k in ("out", "src", "work", "data_dir") else v for k, v in args.items()})
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    report = module.main(cfg)
    write_json(cfg.out, report)
    print(f"written: {cfg.out}")
    return 1 if report.get("errors") else 0
