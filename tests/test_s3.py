"""Runs on object storage, against a real S3 server (SeaweedFS `weed mini`, tests/s3_server.py):
`--storage-path s3://...` from a user's folder (a stop request on SIGUSR1, the same command
continuing, every run file in the bucket, listed through the S3 API), "already finished",
`--resume-from s3://...`, one-line errors in seconds for bad storage, a
sweep's files on S3, storage faults (the server stopped during training; a full local disk), and a
`ray job submit` job whose credentials come from the cluster's environment.

Fault behaviour chosen: training keeps going. A checkpoint that cannot be saved is logged and
skipped (never reported to Ray, so never the latest), the run files catch up once the storage is
back, and the last checkpoint is retried for --retry-storage-s seconds; if it still fails, the run
ends with one `error:` line (exit 1) and the same command later resumes from the last checkpoint
that was saved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from processes import Hold

from conftest import (ROOT, RUN_FILES, SLOW, TINY, Running, assert_refused_before_ray, head_running, one_error_line,
                      strict, train, user_env)
from ray_job.train.checkpoint import MANIFEST_FILE
from ray_job.train.runfiles import Event

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]

def aws_user(server, **overrides: str) -> dict:
    """A user's shell with the AWS variables of the README."""
    return user_env(**{**server.aws_vars(), **overrides})


def joined(head, server) -> dict:
    """The same, in a shell whose runs join the session's Ray head (tests not about start-up)."""
    return head.user_env(**server.aws_vars())


def jsonl(server, key: str) -> list[dict]:
    return [strict(line) for line in server.read(key).decode().splitlines() if line.strip()]


def complete_checkpoints(server, prefix: str) -> list[str]:
    """The checkpoint folders under `prefix` whose manifest (written last) is there."""
    return sorted({k.split("/")[0] for k in server.keys(prefix)
                   if k.startswith("checkpoint_") and k.endswith(f"/{MANIFEST_FILE}")})


def checkpoints(server, prefix: str) -> list[str]:
    return sorted({k.split("/")[0] for k in server.keys(prefix)
                   if k.startswith("checkpoint_") and k.endswith("/checkpoint.pt")})


# --- the README road ----------------------------------------------------------------------------

def test_two_workers_on_s3_stop_continue_and_finished(s3, user_dir, ray_cluster):
    """The README's road: SIGUSR1 (the request goes into the bucket), a stop mid-epoch, the same command
    continues at that step and finishes, every run file is in the bucket, a third run says
    finished. (--resume-from s3://... is in the storage fault test below.) The first run starts its
    own local cluster, as the README's command does; the continuation joins the session's head
    (what it shows is the resume from the bucket, not a cluster's start)."""
    env = aws_user(s3)
    storage = s3.uri("seat")
    # resnet18 (SLOW): its checkpoints go up in parts
    args = [*SLOW, "--synthetic-train-size", "1024", "--storage-path", storage, "--name", "run",
            "--num-workers", "2", "--epochs", "1"]
    first = Running("train", *args, cwd=user_dir, env=env)
    # after the driver cleared an old request ("config:" follows): the request is in the bucket
    # before the first step, and the workers stop at their first poll, whatever the machine's speed
    first.wait_for(lambda: "config:" in first.out, every=0.1)
    first.proc.send_signal(signal.SIGUSR1)  # what slurm_ray_start.sh sends before the time limit
    assert first.finish() == 3, first.out[-4000:]
    assert "Run the same command again to continue" in first.out

    proc = train(user_dir, *args, env=joined(ray_cluster, s3))
    out = first.out + proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"results: {storage}/run" in proc.stdout
    events = jsonl(s3, "seat/run/events.jsonl")
    resumed = [e for e in events if e["event"] == Event.RESUMED]
    assert len(resumed) == 1 and resumed[0]["epoch"] == 0 and 0 < resumed[0]["step"] < 16, events
    assert ".preempt" not in s3.keys("seat/run")  # the request was cleared by the second start

    keys = s3.keys("seat/run")
    for name in RUN_FILES:
        assert name in keys, keys
    assert any(k.startswith("tensorboard/events.out.tfevents.") for k in keys), keys
    assert not os.listdir(user_dir), os.listdir(user_dir)  # nothing written locally
    for key in keys:  # every JSON file parses strictly
        if key.endswith(".jsonl"):
            jsonl(s3, f"seat/run/{key}")
        elif key.endswith(".json"):
            strict(s3.read(f"seat/run/{key}").decode())
    assert strict(s3.read("seat/run/config.json").decode())["storage_path"] == storage
    summary = strict(s3.read("seat/run/summary.json").decode())
    latest = summary["latest_checkpoint"]
    assert summary["finished"] and latest.startswith(f"{storage}/run/checkpoint_")
    assert latest.rsplit("/", 1)[-1] in checkpoints(s3, "seat/run")
    assert [r["epoch"] for r in jsonl(s3, "seat/run/metrics.jsonl")] == [1]
    saved = [e for e in events if e["event"] == Event.CHECKPOINT_SAVED]
    assert len(saved) == 2 and saved[0]["bytes"] > 40e6 and saved[0]["upload_s"] > 0
    # the credentials appear nowhere: not in what was printed, not in any text file in the bucket
    assert s3.secret not in out and s3.key_id not in out
    for key in keys:
        if not key.endswith(".pt"):
            assert s3.secret.encode() not in s3.read(f"seat/run/{key}")

    # the same command again: finished, read from the bucket, no Ray started
    again = train(user_dir, *args, env=env, timeout=120)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "already finished 1 epochs" in again.stdout and "config:" not in again.stdout


# --- fail fast ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["wrong secret", "unknown key", "missing bucket", "dead endpoint",
                                  "read-only user", "secret in the URI"])
def test_bad_storage_fails_before_ray_with_one_line(s3, user_dir, case):
    from ray_job.cluster.ports import free_port

    uri, env = s3.uri("bad"), {}
    if case == "wrong secret":
        env = dict(AWS_SECRET_ACCESS_KEY="not-the-secret")
    elif case == "unknown key":
        env = dict(AWS_ACCESS_KEY_ID="nobody")
    elif case == "missing bucket":
        uri = "s3://no-such-bucket/runs"
    elif case == "dead endpoint":
        env = dict(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    elif case == "read-only user":
        env = dict(AWS_ACCESS_KEY_ID=s3.reader_key_id, AWS_SECRET_ACCESS_KEY=s3.reader_secret)
    else:
        uri = uri + f"?access_key={s3.key_id}&secret_key={s3.secret}"
    proc = train(user_dir, *TINY, "--storage-path", uri, "--name", "x", env=aws_user(s3, **env),
                 timeout=120)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    line = one_error_line(proc.stderr)
    words = {"wrong secret": "refused the credentials", "unknown key": "refused the credentials",
             "missing bucket": "does not exist", "dead endpoint": "cannot reach",
             "read-only user": "no permission to write", "secret in the URI": "not in the URI"}
    assert words[case] in line, line
    assert_refused_before_ray(proc)
    assert s3.secret not in proc.stdout + proc.stderr and "not-the-secret" not in line
    print(f"{case}: {line}")


def test_a_run_folder_on_s3_in_use_is_refused_and_a_stale_lease_taken_over(s3, user_dir, monkeypatch, caplog):
    """The lease on object storage: while a run (here this test's process) holds s3://.../held, the
    same command is refused with one line naming the owner, exit 2, before Ray starts; a lease
    whose heartbeat is older than the bound is taken over with a line; giving it back removes it."""
    import logging

    from ray_job.storage import at
    from ray_job.storage.lease import STALE_S, Lease, Owner

    for k, v in s3.aws_vars().items():
        monkeypatch.setenv(k, v)
    holder = Lease(at(s3.uri("lease/held")))
    holder.take()
    try:
        started = time.monotonic()
        proc = train(user_dir, *TINY, "--storage-path", s3.uri("lease"), "--name", "held",
                     env=aws_user(s3), timeout=120)
        elapsed = time.monotonic() - started
    finally:
        holder.give_back()
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    line = one_error_line(proc.stderr)
    assert "is in use by another run" in line and f"pid {os.getpid()}" in line, line
    assert "worker group" not in proc.stderr
    assert holder.current() is None and s3.keys("lease/held") == []  # the refused run wrote nothing
    print(f"second start on S3 refused after {elapsed:.1f} s: {line}")

    stale = Owner("gone", "elsewhere", 1, "", time.time() - 2 * STALE_S, time.time() - 2 * STALE_S)
    at(s3.uri("lease/stale")).join(".lease.json").write_text(json.dumps(stale.__dict__))
    lease = Lease(at(s3.uri("lease/stale")))
    with caplog.at_level(logging.WARNING, logger="ray_job.lease"):
        lease.take()
    try:
        assert "its last heartbeat was" in caplog.text and lease.current().id == lease.me.id
    finally:
        lease.give_back()
    assert lease.current() is None


def test_settings_from_a_profile_and_the_endpoint_variables(s3, tmp_path):
    """AWS_PROFILE with a credentials file (no key variables); AWS_ENDPOINT_URL as the fallback."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[rjtest]\naws_access_key_id = {s3.key_id}\n"
                     f"aws_secret_access_key = {s3.secret}\n")
    env = {k: v for k, v in s3.env().items()
           if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3")}
    env.update(AWS_PROFILE="rjtest", AWS_SHARED_CREDENTIALS_FILE=str(creds),
               AWS_ENDPOINT_URL=s3.endpoint, AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=ROOT)
    check = [sys.executable, "-m", "ray_job.storage", "check", s3.uri("profile")]
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "writable" in proc.stdout, proc.stderr
    env["AWS_PROFILE"] = "nobody"
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "AWS_PROFILE=nobody" in one_error_line(proc.stderr)

    from ray_job.storage.location import S3Settings

    settings = S3Settings.from_env(s3.env())
    assert settings.endpoint == s3.endpoint.split("://")[1] and settings.scheme == "http"
    assert s3.secret not in repr(settings) and s3.secret not in settings.credentials()


def test_a_sweep_writes_its_points_and_report_to_s3(s3, monkeypatch, capsys):
    """The sweep's own file I/O on S3 (no Ray: `train` is a stand-in that writes a finished run):
    the report's four files, reuse of finished points, an unfinished point moved aside."""
    from ray_job import storage
    from ray_job.scale import main, sweep
    from ray_job.storage import write_json
    from ray_job.train.metrics import EpochMetrics

    for k, v in s3.aws_vars().items():
        monkeypatch.setenv(k, v)
    fields = {f: 1.0 for f in EpochMetrics.__dataclass_fields__}
    final = {**fields, "epoch": 1, "epochs": 1, "steps": 6, "world_size": 1, "grad_bytes": 1000,
             "train_images": 384, "test_images": 256}
    trained = []

    def fake_training(point, parent_id=None):
        trained.append(point.name)
        d = storage.at(point.run_dir())
        write_json(d.join("config.json"), point.to_dict())
        write_json(d.join("summary.json"), dict(finished=True, epochs_completed=1, final=final,
                                                wall_s=9.0, time_to_first_step_s=2.0))
        return 0

    monkeypatch.setattr(sweep, "connect", lambda cfg: None)
    monkeypatch.setattr(sweep, "cluster_info", lambda: dict(nodes=1, cpus=2, gpus=0))
    monkeypatch.setattr(sweep, "run_training", fake_training)
    storage.at(s3.uri("sweeps/s/strong_w2/events.jsonl")).write_text("{}\n")  # an unfinished point
    argv = ["--workers", "1,2", "--mode", "strong", *TINY, "--no-gpu", "--storage-path",
            s3.uri("sweeps"), "--name", "s"]
    assert main(argv) == 0
    keys = s3.keys("sweeps/s")
    for name in ("scaling.json", "scaling.csv", "scaling.md", "scaling.png"):
        assert name in keys, keys
    assert s3.read("sweeps/s/scaling.png")[:8] == b"\x89PNG\r\n\x1a\n"
    rows = strict(s3.read("sweeps/s/scaling.json").decode())["rows"]
    assert [(r["workers"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok")]
    assert any(k.startswith("strong_w2.interrupted-") for k in keys), keys
    assert trained == ["w1", "strong_w2"]
    assert main(argv) == 0 and trained == ["w1", "strong_w2", "w1", "strong_w2"]  # train says done
    rows = strict(s3.read("sweeps/s/scaling.json").decode())["rows"]
    assert all(r["reason"].startswith("reused") for r in rows), rows
    capsys.readouterr()


# --- storage faults -----------------------------------------------------------------------------

FAULT = [*TINY, "--num-workers", "1", "--synthetic-train-size", "1536", "--log-every", "0"]


def test_server_stopped_during_training_keeps_going_and_catches_up(s3, user_dir, ray_cluster):
    """Stopped after epoch 1's checkpoint, started again once epoch 2's checkpoint and a write of
    the run files have failed (a write retried into a server already back would fail nothing): the
    run finishes, epoch 3's checkpoint is saved, and every file has caught up."""
    env = joined(ray_cluster, s3)
    hold = Hold(user_dir.parent).at(2, 1)  # held early in epoch 2 while the server stops
    run = Running("train", *FAULT, "--storage-path", s3.uri("fault"), "--name", "a",
                  "--epochs", "3", cwd=user_dir, env=env | hold.env)
    run.wait_for(lambda: hold.waits_at(2, 1) and complete_checkpoints(s3, "fault/a"), every=0.2)
    s3.stop()
    down = time.monotonic()
    hold.at(3, 1)  # on through epoch 2's end, held again at epoch 3's first step until the server is back
    run.wait_for(lambda: "NOT saved" in run.out and "to write later" in run.out and hold.waits_at(3, 1))
    s3.start()
    hold.release()
    print(f"\nS3 server down for {time.monotonic() - down:.1f} s during epoch 2")
    rc = run.finish()
    assert rc == 0, run.out[-4000:]
    assert "training goes on" in run.out and "caught up" in run.out, run.out[-4000:]
    assert [r["epoch"] for r in jsonl(s3, "fault/a/metrics.jsonl")] == [1, 2, 3]
    events = jsonl(s3, "fault/a/events.jsonl")
    assert [e["epoch"] for e in events if e["event"] == Event.CHECKPOINT_SAVED] == [1, 3]
    assert [e["epoch"] for e in events if e["event"] == Event.CHECKPOINT_FAILED] == [2]
    summary = strict(s3.read("fault/a/summary.json").decode())
    assert summary["finished"] and summary["epochs_completed"] == 3
    from ray_job.train.checkpoint import load_checkpoint
    from ray_job.storage import Location

    latest = summary["latest_checkpoint"].split("://", 1)[1]
    assert load_checkpoint(Location(s3.client(), latest, summary["latest_checkpoint"]))["epoch"] == 3
    assert len(checkpoints(s3, "fault/a")) == 2  # epochs 1 and 3: nothing half-written left


def seed_checkpoint(server, prefix: str, epoch: int) -> str:
    """A checkpoint of FAULT's model written straight into the bucket (no Ray); its URI."""
    import torch

    from ray_job import storage
    from ray_job.config import parse_train_args
    from ray_job.model.optim import build_optimizer
    from ray_job.model import zoo
    from ray_job.train.checkpoint import save_checkpoint

    cfg = parse_train_args(FAULT)
    model = zoo.build(cfg, 10)
    optimizer = build_optimizer(model, cfg, 1, torch.device("cpu"))
    dest = storage.Location(server.client(), f"{server.bucket}/{prefix}", server.uri(prefix))
    save_checkpoint(dest, model=model, optimizer=optimizer, epoch=epoch, step=0, config=cfg.to_dict(),
                    metrics={}, world_size=1)
    return dest.uri


def test_server_down_at_the_end_fails_clearly_then_the_same_command_resumes(s3, user_dir, ray_cluster):
    """A run from --resume-from s3://... (epoch 1 done) to epoch 3; the server is stopped once
    epoch 2's checkpoint is saved and recorded, and is not back before the end: the last checkpoint
    waits --retry-storage-s seconds, then one error line, exit 1. Later the same command resumes
    from epoch 2's checkpoint (Ray's latest wins over --resume-from; a partly written checkpoint
    planted beside it is not taken) and finishes."""
    seed = seed_checkpoint(s3, "seeds/checkpoint_seed", epoch=1)
    env = joined(ray_cluster, s3)
    args = [*FAULT, "--storage-path", s3.uri("fault"), "--name", "b", "--epochs", "3",
            "--resume-from", seed, "--retry-storage-s", "2"]
    hold = Hold(user_dir.parent).at(3, 1)  # held in epoch 3 while the server stops
    run = Running("train", *args, cwd=user_dir, env=env | hold.env)
    run.wait_for(lambda: hold.waits_at(3, 1) and complete_checkpoints(s3, "fault/b"), every=0.2)
    # epoch 2's checkpoint is reported to Ray at the first poll (every 5 steps) after its upload
    hold.at(3, 11)
    run.wait_for(lambda: hold.waits_at(3, 11) and "checkpoint_manager_snapshot.json" in s3.keys("fault/b"),
                 every=0.2)
    (first,) = checkpoints(s3, "fault/b")
    s3.stop()
    hold.release()
    rc = run.finish()
    assert rc == 1, run.out[-4000:]
    line = one_error_line(run.out)
    assert "end of epoch 3 was not saved" in line, line
    assert f"Last checkpoint saved: {s3.uri('fault/b')}/{first}" in line, line

    s3.start()
    assert strict(s3.read("fault/b/config.json").decode())["resume_from"] == seed
    with s3.client().open_output_stream(f"{s3.bucket}/fault/b/checkpoint_2999-01-01_00-00-00.000000/"
                                        "checkpoint.pt") as f:
        f.write(b"PK\x03\x04 half a checkpoint")  # newer by name, but Ray never recorded it
    again = train(user_dir, *args, env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    events = jsonl(s3, "fault/b/events.jsonl")
    assert [(e["epoch"], e["step"]) for e in events if e["event"] == Event.RESUMED] == [(1, 0), (2, 0)]
    assert [r["epoch"] for r in jsonl(s3, "fault/b/metrics.jsonl")] == [2, 3]
    assert strict(s3.read("fault/b/summary.json").decode())["finished"]


def test_full_local_disk_fails_the_checkpoint_and_the_previous_one_stays(user_dir, tmp_path, ray_cluster):
    """A local --storage-path on a small tmpfs: epoch 1's checkpoint (~90 MB) fits, epoch 2's does
    not. One error line naming the disk, exit 1; epoch 1's checkpoint still loads; no partial
    checkpoint is left."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="rjfull", dir="/tmp"))
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=140m", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        shutil.rmtree(mnt, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        # resnet18 (SLOW): checkpoints big enough to fill a small disk
        proc = train(user_dir, *SLOW, "--num-workers", "1", "--log-every", "0", "--storage-path", str(mnt),
                     "--name", "full", "--epochs", "2", "--retry-storage-s", "2", env=ray_cluster.user_env())
        assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
        line = one_error_line(proc.stderr)
        assert "No space left on device" in line and "was not saved" in line, line
        run_dir = mnt / "full"
        folders = [d for d in run_dir.glob("checkpoint_*") if d.is_dir()]
        complete = [d for d in folders if (d / "checkpoint.pt").exists()]
        assert len(complete) == len(folders) == 1, folders
        from ray_job.train.checkpoint import load_checkpoint

        assert load_checkpoint(str(complete[0]))["epoch"] == 1
        assert f"Last checkpoint saved: {complete[0]}" in line
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(mnt, ignore_errors=True)


# --- ray job submit -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_head(s3_server_session):
    """A `ray start --head` cluster started with the AWS variables in its environment, as
    cluster.yaml does: jobs and their workers inherit them, the job's command line has none."""
    with head_running(s3_server_session.aws_vars()) as head:
        yield head


def test_submitted_job_writes_to_s3_with_credentials_from_the_cluster(s3, s3_head):
    import secrets

    job_id = f"s3-{secrets.token_hex(4)}"
    client = {k: v for k, v in s3_head.client_env().items() if not k.startswith("AWS_")}
    entry = [sys.executable, "-m", "ray_job", "train", *TINY, "--num-workers", "1", "--epochs", "1",
             "--storage-path", s3.uri("jobs"), "--name", "submitted"]
    proc = s3_head.job("submit", "--submission-id", job_id, "--working-dir", ROOT, "--no-wait",
                       "--", *entry, env=client)
    assert proc.returncode == 0, proc.stdout[-3000:]
    status = s3_head.wait_for_job(job_id, timeout=300)
    logs = s3_head.job("logs", job_id, env=client).stdout
    assert status == "SUCCEEDED", logs[-4000:]
    keys = s3.keys("jobs/submitted")
    for name in RUN_FILES:
        assert name in keys, keys
    assert checkpoints(s3, "jobs/submitted")
    info = json.dumps(s3_head.api(f"/api/jobs/{job_id}"))
    for text in (logs, info, " ".join(entry), s3.read("jobs/submitted/config.json").decode()):
        assert s3.secret not in text
    # The head ran our defaults (ray_job/cluster/rayenv.py): Ray started no idle Python workers ahead
    # for the first driver. Those belong to no job (ffffffff in their log names); with Ray's own
    # default there were two here (a head of 2 CPUs).
    ahead = list((Path(s3_head.temp_dir) / "session_latest" / "logs").glob("worker-*-ffffffff-*.out"))
    assert not ahead, ahead
