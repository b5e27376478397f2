"""The per-worker training function that TorchTrainer runs on every rank, top to bottom.

Ray appears only where it must: prepare_model and prepare_data_loader (build.py), get_context,
get_checkpoint and report. An epoch is plain PyTorch (engine.py); after each step the step control
answers CONTINUE, CHECKPOINT or STOP (control.py) and this loop acts on it; the checkpointer saves,
verifies, records and reports each checkpoint (checkpointer.py).

Storage faults: a checkpoint that cannot be saved is logged and skipped -- never reported, so never
taken as the latest -- and training goes on; the next checkpoint tries again, and the run files
catch up once the storage is back. The last checkpoint (end of run, stop request) is retried for up
to --retry-storage-s seconds; if it still fails, the run ends with that error and the same command
later resumes from the last checkpoint that was saved.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import ray.train
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.jsonio import finite
from ..data.datasets import load_datasets
from .build import (Run, announce, build_run, epoch_metrics, first_error, log_topology, preprocess_for, run_store,
                    setup_logging)
from .checkpointer import Checkpointer, RayLink, Resume, where
from .control import Action, StepControl, controlled_steps
from .engine import EpochSteps, evaluate, measure_comm_wait
from .metrics import EpochMetrics
from .progress import Progress
from .runfiles import Event
from .runlog import RunLog

log = logging.getLogger("ray_job")


def ray_link() -> RayLink:
    """Checkpoints reported on Ray's own filesystem object: Ray keeps, deletes and hands them back."""
    storage_ctx = ray.train.get_context().get_storage()

    def report(metrics: dict, path: Optional[str]) -> None:
        checkpoint = (ray.train.Checkpoint(path=path, filesystem=storage_ctx.storage_filesystem)
                      if path else None)
        ray.train.report(finite(metrics), checkpoint=checkpoint,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)

    return RayLink(storage_ctx.make_default_checkpoint_dir_name, report)


def train_loop_per_worker(config: dict) -> dict:
    cfg = TrainConfig(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_logging(rank)
    torch.manual_seed(cfg.seed + rank)
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    store = run_store(cfg)
    files = RunLog(store) if rank == 0 else None  # rank 0's writer of the run folder
    checkpointer = Checkpointer(store, ray_link(), rank == 0, files, cfg.retry_storage_s, cfg.async_checkpoints)
    # Bad input found here (data, checkpoint) is no fault a restart fixes: every rank learns of
    # it before the first collective of DDP, and the run ends at once with the driver's error.
    error, data, resume = None, None, Resume()
    try:
        data = load_datasets(cfg)
        resume = resume_state(cfg, checkpointer, rank, world)
    except UsageError as e:
        error = str(e)
    error = first_error(error, world)
    if error:
        return {"usage_error": error}
    run = build_run(cfg, data, resume, rank, world, store, files)
    log_topology(run, dist.get_backend() if dist.is_initialized() else "none (1 worker)")
    return fit(run, resume, checkpointer)


def resume_state(cfg: TrainConfig, checkpointer: Checkpointer, rank: int, world: int) -> Resume:
    """Rank 0 chooses the newest checkpoint that verifies; every rank loads that one."""
    recorded = ray.train.get_checkpoint()
    chosen, state, problem = None, None, None
    if rank == 0:
        try:
            chosen, state = checkpointer.choose(recorded.path.rstrip("/").rsplit("/", 1)[-1] if recorded else None)
        except UsageError as e:
            problem = str(e)
    if world > 1:  # the choice (or rank 0's error) to every rank
        shared = [(chosen, problem)]
        dist.broadcast_object_list(shared, src=0)
        chosen, problem = shared[0]
    if problem:
        raise UsageError(problem)
    return checkpointer.resume(chosen, state, cfg.resume_from, world)


def fit(run: Run, resume: Resume, checkpointer: Checkpointer) -> dict:
    cfg = run.cfg
    preprocess = preprocess_for(run)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    if run.is_rank0:
        announce(run, resume)
    control = StepControl(run.store, run.is_rank0, run.device, checkpoint_every_s=cfg.checkpoint_every_min * 60,
                          saver=checkpointer)
    last: Optional[EpochMetrics] = None
    comm_wait, error = None, None
    for epoch in range(resume.epoch, cfg.epochs):
        if isinstance(getattr(run.train_loader, "sampler", None), DistributedSampler):
            run.train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch
        skip = resume.step if epoch == resume.epoch else 0
        progress = None
        if run.is_rank0:
            run.files.event(Event.EPOCH_START, epoch=epoch + 1, step=skip)
            progress = Progress(cfg.progress, epoch, cfg.epochs, run.steps_per_epoch, skip,
                                cfg.global_batch(run.world), cfg.log_every, eval_s=last.eval_s if last else None)
        steps = EpochSteps(run.model, run.optimizer, run.scheduler, loss_fn, preprocess, run.device,
                           run.speed.bf16, cfg.sync_timing)
        action, position = Action.CONTINUE, skip
        for step, action in controlled_steps(steps, run.train_loader, run.steps_per_epoch, skip, control, progress):
            position = step.number
            if control.take_report():  # rank 0's background upload is over
                checkpointer.report_saved()
            if action is Action.CHECKPOINT:
                log.info("checkpoint after %g min: epoch %d step %d", cfg.checkpoint_every_min, epoch + 1,
                         step.number)
                checkpointer.save(partial(run.state, epoch, position, last),
                                  dict(epoch=epoch, step=position, preempted=False, test_acc=-1.0))
                control.checkpointed()
            elif action is Action.STOP:
                break
        stats = steps.finish()
        if progress:
            progress.close()
        if run.is_rank0 and stats.first_step_time is not None and epoch == resume.epoch:
            run.files.event(Event.FIRST_STEP, time=stats.first_step_time, epoch=epoch + 1)
        if action is Action.STOP:  # a stop was requested: save where we are and stop
            return stop_here(run, control, checkpointer, epoch, position, last)
        if comm_wait is None and run.world > 1 and cfg.steps_per_epoch:
            comm_wait = measure_comm_wait(run.model, next(iter(run.train_loader)), loss_fn, preprocess,
                                          run.device, run.speed.bf16)
        test = evaluate(run.model, run.test_loader, torch.nn.CrossEntropyLoss(), preprocess, run.device,
                        run.speed.bf16)
        last = epoch_metrics(run, epoch, stats, test, comm_wait)
        if run.is_rank0:
            run.files.epoch(last)
            log.info(last.line())
        # asked during the epoch's last steps: this epoch's checkpoint is the one to stop with
        stopping = control.at_epoch_end() and epoch + 1 < cfg.epochs
        if control.take_report():
            checkpointer.report_saved()
        error = checkpointer.save(partial(run.state, epoch + 1, 0, last), last.to_dict(),
                                  last=stopping or epoch + 1 == cfg.epochs)
        control.checkpointed()
        if stopping:
            log.info("stop requested: checkpoint at the end of epoch %d, stopping", epoch + 1)
            return finish(run, control, {"preempted": True, "epoch": epoch + 1, "step": 0}, error)
    return finish(run, control, {"preempted": False, "epoch": cfg.epochs}, error)


def stop_here(run: Run, control: StepControl, checkpointer: Checkpointer, epoch: int, step: int,
              last: Optional[EpochMetrics]) -> dict:
    log.info("stop requested: checkpoint at %s, stopping", where(epoch, step))
    control.settle()
    if control.take_report():
        checkpointer.report_saved()
    error = checkpointer.save(partial(run.state, epoch, step, last),
                              dict(epoch=epoch, step=step, preempted=True, test_acc=-1.0), last=True)
    return finish(run, control, {"preempted": True, "epoch": epoch, "step": step}, error)


def finish(run: Run, control: StepControl, outcome: dict, error: Optional[str]) -> dict:
    """The loop's result; rank 0 writes the run files that are left and adds a storage error."""
    control.close()
    if run.is_rank0:
        unwritten = run.files.close(0.0 if error else run.cfg.retry_storage_s)
        error = error or unwritten
        if error:
            outcome["storage_error"] = error
    return outcome
