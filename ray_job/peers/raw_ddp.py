"""BASELINE, not a product: the raw-DDP baseline, the hand-written PyTorch DDP script users copy today.

Users' alternative to ray_job is this script started with torchrun or srun. It is kept short and
faithful so that `python -m ray_job bench vs-ddp` and `bench race` measures against what they would really run;
do not grow it into a second trainer (that is `python -m ray_job train`).

What it does, as such scripts do:
  - plain torch.distributed, no Ray: env:// rendezvous, rank / world size / local rank from
    torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from srun (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID; MASTER_ADDR defaults to the first node's NodeAddr, MASTER_PORT to one derived
    from the job id); gloo on CPU, nccl on GPU (one GPU per process, by local rank);
  - a torchvision ResNet (its own stem and 1000-class head by default), fp32, PIL transforms per
    sample in a DataLoader with 0 workers, DistributedSampler with set_epoch;
  - a global batch of 128 split across the processes; SGD, lr 1e-4, momentum 0.9, constant;
  - rank 0 prints every 10 steps (loss, data ms, train ms) and saves a checkpoint after every
    epoch; `--checkpoint PATH` resumes from one.
Additions for measuring, none of which changes the recipe: a test-set evaluation after each epoch
(every image counted once), `--target-acc` / `--time-budget-s` to stop early, `--steps-per-epoch`,
`--report-json`. Checkpoints use ray_job's checkpoint.pt format (ray_job.train.checkpoint).

    torchrun --nproc-per-node 2 -m ray_job.peers.raw_ddp --data synthetic --epochs 2
    srun --ntasks 2 python -m ray_job.peers.raw_ddp --data cifar10 --data-dir /shared/cifar10
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ..config import DATASETS, RESNETS, STEMS, TrainConfig
from ..core.errors import UsageError
from ..core.flags import option
from ..core.paths import resolve_path
from ..train.checkpoint import load_checkpoint, save_checkpoint
from ..train.engine import EpochStats, evaluate, global_sums, peak_rss_gib


@dataclasses.dataclass(frozen=True)
class BaselineArgs:
    model: str = option("resnet50", "torchvision ResNet", choices=RESNETS)
    stem: str = option("imagenet", "'imagenet': torchvision's own stem, as the baseline has it; 'cifar': ray_job's "
                       "CIFAR stem (for same-model comparisons)", choices=STEMS)
    num_classes: int = option(1000, "outputs of the head (the baseline keeps torchvision's 1000)")
    data: str = option("cifar10", "cifar10 (cifar-10-batches-py under --data-dir, downloaded if missing), "
                       "imagefolder (DIR/{train,test}/<class>/*), or synthetic", choices=DATASETS)
    data_dir: str = option("./data", "dataset folder")
    synthetic_train_size: int = option(1024, "images in the synthetic train split")
    synthetic_test_size: int = option(256, "images in the synthetic test split")
    epochs: int = option(30, "epochs to train")
    batch_size: int = option(128, "global batch, split evenly across the processes (the baseline's 128)")
    lr: float = option(1e-4, "SGD learning rate, constant")
    momentum: float = option(0.9, "SGD momentum")
    loader_workers: int = option(0, "DataLoader worker processes per process")
    print_every: int = option(10, "rank 0 prints loss, data ms and train ms every N steps (0 = never)")
    checkpoint: str = option("", "resume from this checkpoint (epoch_<N>/ folder or its checkpoint.pt)")
    checkpoint_dir: str = option("./checkpoints", "rank 0 writes <dir>/epoch_<N>/checkpoint.pt after every epoch")
    steps_per_epoch: int = option(0, "cap on steps per epoch (0 = the whole epoch); an evaluation follows")
    eval: bool = option(True, "evaluate test accuracy after every epoch")
    target_acc: float = option(0.0, "stop after the first evaluation at or above this test accuracy (0 = off)")
    time_budget_s: float = option(0.0, "stop after the first epoch that ends this many seconds after start (0 = off)")
    report_json: str = option("", "rank 0 writes per-epoch times and accuracies here (strict JSON)")
    seed: int = option(0, "random seed (model init, synthetic data, shuffling)")

    def __post_init__(self) -> None:  # the choices: argparse checks them
        if min(self.epochs, self.batch_size, self.num_classes) <= 0:
            raise UsageError("--epochs, --batch-size and --num-classes must be positive")
        if min(self.steps_per_epoch, self.loader_workers, self.print_every, self.lr) < 0:
            raise UsageError("--steps-per-epoch, --loader-workers, --print-every and --lr must not be negative")


# --- processes ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    launcher: str  # "torchrun", "srun" or "single"


def dist_env(env=os.environ) -> DistEnv:
    """Who this process is: torchrun's variables first, then srun's, else a single process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:  # a task of srun
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       "srun")
    return DistEnv(0, 1, 0, "single")


def slurm_master(env=os.environ) -> tuple[str, str]:
    """MASTER_ADDR / MASTER_PORT under srun: as set, else the first node's NodeAddr and a port
    derived from the job id (every task computes the same)."""
    from ..cluster.ports import job_port
    from ..cluster.slurm import node_addr, node_names

    port = env.get("MASTER_PORT") or str(job_port(env, int(env.get("SLURM_JOB_ID", "0"))))
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"], port
    return node_addr(node_names(env["SLURM_JOB_NODELIST"])[0]), port


def init_distributed(env: DistEnv) -> torch.device:
    """The device of this process; joins the process group (env://) when launched as one of many."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if env.launcher == "single":
        return device
    if env.launcher == "srun":
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = slurm_master()
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=env.rank,
                            world_size=env.world)
    return device


def wrap_ddp(model: nn.Module, device: torch.device, world: int, **kwargs) -> nn.Module:
    """DDP when there is more than one process (as Ray's prepare_model does)."""
    if world <= 1:
        return model
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, **kwargs)


# --- the recipe --------------------------------------------------------------------------------

def build_baseline_model(arch: str, num_classes: int, stem: str) -> nn.Module:
    """torchvision's ResNet with its own initialisation, as the baseline builds it."""
    model = torchvision.models.__dict__[arch](weights=None, num_classes=num_classes)
    if stem == "cifar":  # the one definition of the CIFAR stem is ray_job.model's
        from ..model.zoo import named as build_model

        ref = build_model(arch, "cifar", num_classes)
        model.conv1, model.maxpool = ref.conv1, ref.maxpool
    return model


def baseline_optimizer(model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def baseline_train_loader(split, per_rank_batch: int, env: DistEnv, workers: int, seed: int,
                      distributed_sampler: bool = True) -> DataLoader:
    """PIL transforms per sample; DistributedSampler when several processes share the data
    (`distributed_sampler=False` leaves that to Ray's prepare_data_loader)."""
    from ..data.arrays import TorchvisionDataset

    ds = TorchvisionDataset(split, train=True)
    sampler = (DistributedSampler(ds, num_replicas=env.world, rank=env.rank, shuffle=True, seed=seed)
               if distributed_sampler and env.world > 1 else None)
    return DataLoader(ds, batch_size=per_rank_batch, shuffle=sampler is None, sampler=sampler,
                      num_workers=workers)


def set_epoch(loader, epoch: int) -> None:
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):  # also a loader Ray's prepare_* made
        loader.sampler.set_epoch(epoch)


def train_epoch(model: nn.Module, loader, optimizer, criterion, device: torch.device, epoch: int,
                epochs: int, env: DistEnv, print_every: int = 10, max_steps: int = 0) -> EpochStats:
    """The baseline's loop: copy, forward, backward, step, read the loss, print every N steps."""
    model.train()
    steps = min(len(loader), max_steps) if max_steps else len(loader)
    stats = EpochStats()
    window_data = window_train = 0.0
    start = end = time.perf_counter()
    for i, (images, labels) in enumerate(loader):
        images, labels = images.to(device), labels.to(device)
        t_data = time.perf_counter()
        outputs = model(images)
        loss = criterion(outputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = loss.item()  # the baseline reads the loss every step (a device sync on GPU)
        t_train = time.perf_counter()
        stats.data_s += t_data - end
        stats.fwd_bwd_s += t_train - t_data
        window_data += t_data - end
        window_train += t_train - t_data
        stats.step_times.append(t_train - end)
        stats.loss_sum += loss_value * labels.size(0)
        stats.count += labels.size(0)
        stats.steps += 1
        if stats.first_step_time is None:
            stats.first_step_time = time.time()
        if env.rank == 0 and print_every and (i + 1) % print_every == 0:
            n = min(print_every, stats.steps)
            print(f"Epoch [{epoch + 1}/{epochs}], Step [{i + 1}/{steps}], Loss: {loss_value:.4f}, "
                  f"data {1000 * window_data / n:.1f} ms, train {1000 * window_train / n:.1f} ms", flush=True)
            window_data = window_train = 0.0
        end = time.perf_counter()
        if stats.steps >= steps:
            break
    stats.wall_s = time.perf_counter() - start
    return stats


def test_accuracy(model: nn.Module, loader, device: torch.device) -> float:
    """Accuracy over the whole test set: every rank's share, summed over all ranks."""
    stats = evaluate(model, loader, nn.CrossEntropyLoss(), lambda x, train: x.to(device), device)
    correct, count = global_sums([stats.correct, stats.count], device)
    return correct / max(count, 1)


# --- main --------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]]) -> BaselineArgs:
    from ..core.flags import ArgumentParser, Formatter, add_dataclass_args

    parser = ArgumentParser(prog="python -m ray_job.peers.raw_ddp", formatter_class=Formatter,
                            description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BaselineArgs)
    args = BaselineArgs(**vars(parser.parse_args(argv)))
    return dataclasses.replace(args, **{name: resolve_path(getattr(args, name)) for name in
                                        ("data_dir", "checkpoint", "checkpoint_dir", "report_json")})


def train(args: BaselineArgs) -> dict:
    started = time.time()
    env = dist_env()
    device = init_distributed(env)
    if env.world > args.batch_size:
        raise UsageError(f"--batch-size {args.batch_size} (global) is smaller than the {env.world} processes")
    torch.manual_seed(args.seed)
    from ..data.arrays import TorchvisionDataset
    from ..data.datasets import load_splits

    train_split, test_split = load_splits(TrainConfig(
        data=args.data, data_dir=args.data_dir, seed=args.seed, synthetic_train_size=args.synthetic_train_size,
        synthetic_test_size=args.synthetic_test_size))
    per_rank = args.batch_size // env.world
    model = wrap_ddp(build_baseline_model(args.model, args.num_classes, args.stem).to(device), device, env.world)
    optimizer = baseline_optimizer(model, args.lr, args.momentum)
    start_epoch = 0
    if args.checkpoint:
        state = load_checkpoint(args.checkpoint)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if env.rank == 0:
            print(f"resumed from {args.checkpoint}: {start_epoch} epoch(s) done", flush=True)
    train_loader = baseline_train_loader(train_split, per_rank, env, args.loader_workers, args.seed)
    test_ds = TorchvisionDataset(test_split, train=False)  # each rank its share, every image once
    test_loader = DataLoader(test_ds, batch_size=per_rank, sampler=range(env.rank, len(test_ds), env.world),
                             num_workers=args.loader_workers)
    criterion = nn.CrossEntropyLoss()
    if env.rank == 0:
        print(f"raw_ddp: {env.launcher}, world size {env.world}, "
              f"{dist.get_backend() if dist.is_initialized() else 'no process group'}, {device}, "
              f"{args.model}/{args.stem} stem, global batch {per_rank * env.world} ({per_rank} per process), "
              f"lr {args.lr:g}", flush=True)
    report = dict(args=dataclasses.asdict(args), launcher=env.launcher, world_size=env.world,
                  device=str(device), started=started, first_step_time=None, start_epoch=start_epoch,
                  epochs=[], stopped="epochs")
    for epoch in range(start_epoch, args.epochs):
        set_epoch(train_loader, epoch)
        stats = train_epoch(model, train_loader, optimizer, criterion, device, epoch, args.epochs, env,
                            args.print_every, args.steps_per_epoch)
        report["first_step_time"] = report["first_step_time"] or stats.first_step_time
        acc = test_accuracy(model, test_loader, device) if args.eval else None
        row = dict(epoch=epoch + 1, time=time.time(), train_loss=stats.loss_sum / max(stats.count, 1),
                   test_acc=acc, steps=stats.steps, images_per_s=stats.count * env.world / stats.wall_s)
        report["epochs"].append(row)
        if env.rank == 0:
            path = save_checkpoint(os.path.join(args.checkpoint_dir, f"epoch_{epoch + 1}"),
                                   model=getattr(model, "module", model), optimizer=optimizer,
                                   epoch=epoch + 1, step=0, config=dataclasses.asdict(args),
                                   metrics=row, world_size=env.world)
            print(f"Epoch [{epoch + 1}/{args.epochs}] done: train loss {row['train_loss']:.4f}, "
                  f"test accuracy {'-' if acc is None else f'{acc:.4f}'}, {row['images_per_s']:.0f} img/s, "
                  f"checkpoint {path}", flush=True)
        reached = acc is not None and args.target_acc > 0 and acc >= args.target_acc
        over = args.time_budget_s > 0 and time.time() - started > args.time_budget_s
        # rank 0's clock decides, so that every rank stops after the same epoch
        over = global_sums([float(over and env.rank == 0)], device)[0] > 0
        if reached or over:
            report["stopped"] = "target" if reached else "budget"
            break
    report["peak_host_mem_gib"] = peak_rss_gib()
    if env.rank == 0 and args.report_json:
        from ..storage import write_json

        os.makedirs(os.path.dirname(args.report_json) or ".", exist_ok=True)
        write_json(args.report_json, report)
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def main(argv: Optional[list[str]] = None) -> int:
    try:
        train(parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
