"""Exit codes of every command, and what each means for a SLURM job: the one table that the
driver returns, the SLURM script acts on (`python -m ray_job.cluster exit-action N`) and the docs
list."""

from __future__ import annotations

import enum
import signal
from typing import Optional


class ExitCode(enum.IntEnum):
    DONE = 0             # finished, or already finished
    FAILED = 1           # training failed (worker errors past --max-failures, storage failed at the end)
    BAD_INPUT = 2        # one line says what to fix; nothing was overwritten
    STOPPED = 3          # stopped on request (SIGUSR1, .preempt) with a checkpoint
    CLUSTER_DOWN = 4     # slurm_ray_start.sh: the Ray cluster did not come up
    NO_RESOURCES = 5     # the workers did not fit for --resource-wait-s; nothing new saved
    INTERRUPTED = 130    # Ctrl-C (SIGINT): a checkpoint where it stopped (a second Ctrl-C aborts: none)
    TERMINATED = 143     # SIGTERM: likewise


def is_stop(rc: int) -> bool:
    """Stopped with a checkpoint: on request, Ctrl-C or SIGTERM."""
    return rc in (ExitCode.STOPPED, ExitCode.INTERRUPTED, ExitCode.TERMINATED)


def slurm_action(rc: Optional[int], stop_requested: bool, run_name: str = "") -> tuple[str, int, str]:
    """What slurm_ray_start.sh does when the driver exits with `rc` (None: the job was asked to
    stop before the driver started): ("requeue", the status to exit with if Slurm refuses the
    requeue, why) -- the job comes back and resumes from its latest checkpoint -- or ("exit", rc,
    why, "" if the driver said it already). After a stop request (USR1: preemption, the time limit)
    every status but done and bad input requeues; a lost node (NO_RESOURCES) requeues so that
    Slurm gives the job healthy nodes; a driver killed by a signal (the OOM killer) fails the job
    with the way to continue."""
    if stop_requested and rc not in (ExitCode.DONE, ExitCode.BAD_INPUT):
        return "requeue", int(ExitCode.STOPPED), "stopped for the time limit or a preemption"
    if rc == ExitCode.NO_RESOURCES:
        return ("requeue", int(ExitCode.NO_RESOURCES),
                "the cluster lost the resources for the workers; requeueing, so that Slurm gives the job healthy nodes")
    if rc is not None and rc > 128 and not is_stop(rc):
        return "exit", rc, (f"ERROR: the driver was killed by signal {rc - 128} ({signal_name(rc - 128)}), e.g. by "
                            f"the OOM killer; the run's checkpoints are kept: resubmit with RJ_RUN_NAME={run_name} "
                            "to continue from the latest")
    return "exit", int(rc or 0), ""


def signal_name(number: int) -> str:
    """'KILL' for 9, as `kill -l 9` says it; '?' for a number that is no signal."""
    try:
        return signal.Signals(number).name.removeprefix("SIG")
    except ValueError:
        return "?"
