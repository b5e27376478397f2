"""The per-worker training function that TorchTrainer runs on every rank, top to bottom.

Ray appears only where it must: prepare_model and prepare_data_loader (build.ray_placement),
get_context, get_checkpoint and report (`ray_link`); from `train_run` down it runs without Ray
(tests/test_worker_loop.py). After each step the step control answers one `Decision` (control.py)
and `Loop.act` carries it out; the checkpointer saves, verifies, records and reports (checkpointer.py,
which also says what a storage fault costs). A final checkpoint that could not be saved ends the run
with its error; the same command later resumes from the last checkpoint that was.
"""

from __future__ import annotations

import dataclasses
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
from ..model.parts import unwrap
from ..model.sharding import sync_buffers
from .build import (Run, Worker, announce, build_run, epoch_metrics, gather, log_topology, ray_placement, run_store,
                    setup_logging)
from .checkpointer import UNSCORED, Checkpointer, RayLink, Resume, where
from .control import GO_ON, Decision, StepControl, controlled_steps
from .engine import EpochStats, evaluate, measure_comm_wait, memory_in_use, reset_peak_memory
from .hold import Hold
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
    worker = Worker(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size())
    setup_logging(worker)
    torch.manual_seed(cfg.seed + worker.rank)
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    store = run_store(cfg)
    files = RunLog(store) if worker.master_process else None
    checkpointer = Checkpointer(store, ray_link(), worker.master_process, files, cfg.retry_storage_s,
                                cfg.async_checkpoints)
    # Bad input found here (data, checkpoint) is no fault a restart fixes: every rank learns of
    # it before the first collective of DDP, and the run ends at once with the driver's error.
    error, data, resume = None, None, Resume()
    try:
        data = load_datasets(cfg)
        resume = resume_state(cfg, checkpointer, worker)
    except UsageError as e:
        error = str(e)
    error = next((e for e in gather(error, worker.world) if e), None)  # the first rank's, so all stop together
    if error:
        return {"usage_error": error}
    run = build_run(cfg, data, resume, worker, store, files, ray_placement())
    log_topology(run, dist.get_backend() if dist.is_initialized() else "none (1 worker)")
    return train_run(run, resume, checkpointer)


def resume_state(cfg: TrainConfig, checkpointer: Checkpointer, worker: Worker) -> Resume:
    """Rank 0 chooses the newest checkpoint that verifies; every rank loads that one."""
    recorded = ray.train.get_checkpoint()
    chosen, state, problem = None, None, None
    if worker.master_process:
        try:
            chosen, state = checkpointer.choose(recorded.path.rstrip("/").rsplit("/", 1)[-1] if recorded else None)
        except UsageError as e:
            problem = str(e)
    if worker.world > 1:  # the choice (or rank 0's error) to every rank
        shared = [(chosen, problem)]
        dist.broadcast_object_list(shared, src=0)
        chosen, problem = shared[0]
    if problem:
        raise UsageError(problem)
    return checkpointer.resume(chosen, state, cfg.resume_from, cfg.global_batch, worker.world)


def train_run(run: Run, resume: Resume, checkpointer: Checkpointer) -> dict:
    """From the resumed position to the last epoch or a stop: the outcome the driver reads."""
    if run.worker.master_process:
        announce(run, resume)
    loop = Loop(run, checkpointer)
    try:
        return loop.train(resume)
    finally:
        loop.control.close()


def first_step_memory(run: Run) -> bool:
    """Rank 0, after this start's first step: the memory it took, as the memory plan's sequel (the
    run log and a `first_step_memory` event): its peak, the model states it holds, and the rest --
    activations and workspace, which the plan could not know. False: measured."""
    from ..model.sharding import local_state_bytes

    held = local_state_bytes(unwrap(run.model), run.optimizer)
    peak, after = memory_in_use(run.device, peak=True), memory_in_use(run.device)
    states = sum(held.values())
    where = "GPU memory allocated" if run.device.type == "cuda" else "resident memory"
    log.info("first step on rank 0: peak %.2f GiB of %s; model states %s (parameters %s, gradients %s, "
             "optimizer state %s); activations and workspace ~%.2f GiB", peak / 2**30, where, mib(states),
             mib(held["params"]), mib(held["grads"]), mib(held["optimizer"]), max(peak - after, 0) / 2**30)
    run.files.event(Event.FIRST_STEP_MEMORY, peak_bytes=peak, after_bytes=after, activations_bytes=max(peak - after, 0),
                    **{f"{k}_bytes": v for k, v in held.items()})
    return False


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Loop:
    """One worker's epochs. A position is (`done`, `step`): `done` epochs finished, `step` steps
    into the next -- what a checkpoint and its report call `epoch` and `step`."""

    def __init__(self, run: Run, checkpointer: Checkpointer):
        cfg = run.cfg
        self.run, self.cfg, self.checkpointer = run, cfg, checkpointer
        self.control = StepControl(run.store, run.worker.master_process, run.device,
                                   checkpoint_every_s=cfg.checkpoint_every_min * 60,
                                   busy=checkpointer.busy, upload_over=checkpointer.upload_over)
        self.progress = (Progress(cfg.progress, cfg.epochs, run.steps_per_epoch, cfg.global_batch(run.worker.world),
                                  cfg.log_every) if run.worker.master_process else None)
        self.hold = Hold.from_env(run.worker.master_process)  # RJ_HOLD_FILE (hold.py)
        self.finished: Optional[EpochMetrics] = None  # the metrics of the last epoch finished here
        self.comm_wait: Optional[float] = None
        self.storage_error: Optional[str] = None     # the final checkpoint's, if it was not saved

    def train(self, resume: Resume) -> dict:
        for done in range(resume.epoch, self.cfg.epochs):
            skip = resume.step if done == resume.epoch else 0
            step, decision, stats = self.train_epoch(done, skip, first=done == resume.epoch)
            if decision.stop:  # asked during the epoch: checkpoint where it is and stop
                return self.act(self.settle(decision), done, step)
            self.evaluate(done, stats)
            # asked during the epoch's last steps: this epoch's checkpoint is the one to stop with
            end = self.settle(Decision(checkpoint=True))
            last = done + 1 == self.cfg.epochs  # a stop asked now changes nothing
            outcome = self.act(dataclasses.replace(end, stop=end.stop and not last), done + 1, 0)
            if outcome is not None:
                return outcome
        return self.outcome(self.cfg.epochs, 0, stopped=False)

    def train_epoch(self, done: int, skip: int, first: bool) -> tuple[int, Decision, EpochStats]:
        """Epoch `done + 1` from step `skip`: where it ended, on which decision (a stop is not acted
        on here), and its stats."""
        run = self.run
        if isinstance(getattr(run.train_loader, "sampler", None), DistributedSampler):
            run.train_loader.sampler.set_epoch(done)  # a new shuffle every epoch
        if run.worker.master_process:
            run.files.event(Event.EPOCH_START, epoch=done + 1, step=skip)
            self.progress.start_epoch(done, skip, self.finished.eval_s if self.finished else None)
        position, decision = skip, GO_ON
        measure = first and run.worker.master_process
        if measure:
            reset_peak_memory(run.device)
        for step, decision in controlled_steps(run.steps, run.train_loader, run.steps_per_epoch, skip, self.control,
                                               self.progress):
            if measure:
                measure = first_step_memory(run)
            position = step.number
            self.hold.after_step(done + 1, position)
            if decision.stop:
                break
            if decision is not GO_ON:
                self.act(decision, done, position)
        stats = run.steps.finish()
        if run.worker.master_process:
            self.progress.close()
            if first and stats.first_step_time is not None:
                run.files.event(Event.FIRST_STEP, time=stats.first_step_time, epoch=done + 1)
        return position, decision, stats

    def evaluate(self, done: int, stats: EpochStats) -> None:
        """The finished epoch's global metrics (with --measure-comm-wait, DDP's all-reduce wait)."""
        run = self.run
        if self.comm_wait is None and run.worker.world > 1 and self.cfg.measure_comm_wait:
            self.comm_wait = measure_comm_wait(run.steps, next(iter(run.train_loader)))
        sync_buffers(run.model)  # sharded: every rank evaluates with rank 0's BatchNorm statistics
        test = evaluate(run.model, run.test_loader, torch.nn.CrossEntropyLoss(), run.steps.preprocess, run.device,
                        run.speed.bf16)
        self.finished = epoch_metrics(run, done, stats, test, self.comm_wait)
        if run.worker.master_process:
            run.files.epoch(self.finished)
            log.info(self.finished.line())

    def settle(self, decision: Decision) -> Decision:
        """Before a stop's checkpoint and at an epoch's end: rank 0 waits for its upload, then every
        rank looks at once, so the upload is reported first and the next checkpoint never waits."""
        self.checkpointer.wait_for_upload()
        look = self.control.look_now()
        return dataclasses.replace(look, stop=look.stop or decision.stop, checkpoint=decision.checkpoint)

    def act(self, decision: Decision, done: int, step: int) -> Optional[dict]:
        """The one place a decision is carried out, the same on every rank: report rank 0's finished
        upload, then checkpoint here -- reported with the epoch's metrics at an epoch's end, else with
        the position (UNSCORED: never the best); after a stop's checkpoint, the outcome."""
        stop = decision.stop
        if decision.report_saved:
            self.checkpointer.report_saved()
        if stop or decision.checkpoint:
            if stop:
                log.info("stop requested: checkpoint at %s, stopping", where(done, step))
            elif step:
                log.info("checkpoint after %g min: %s", self.cfg.checkpoint_every_min, where(done, step))
            report = (self.finished.to_dict() if step == 0 else
                      dict(epoch=done, step=step, preempted=stop, test_acc=UNSCORED))
            final = stop or (done, step) == (self.cfg.epochs, 0)  # written before save() returns
            sync_buffers(self.run.model)  # sharded: the checkpoint holds what every rank evaluates with
            error = self.checkpointer.save(partial(self.run.state, done, step, self.finished), report, final=final)
            self.storage_error = self.storage_error or error
            self.control.checkpointed()
        return self.outcome(done, step, stopped=True) if stop else None

    def outcome(self, done: int, step: int, stopped: bool) -> dict:
        """The loop's result; rank 0 writes the run files that are left and adds a storage error."""
        outcome = {"preempted": True, "epoch": done, "step": step} if stopped else {"preempted": False, "epoch": done}
        error = self.storage_error
        if self.run.worker.master_process:
            unwritten = self.run.files.close(0.0 if error else self.cfg.retry_storage_s)
            error = error or unwritten
        if error:
            outcome["storage_error"] = error
        return outcome
