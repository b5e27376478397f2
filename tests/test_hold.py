"""RJ_HOLD_FILE (ray_job/train/hold.py): rank 0 waits at the step the file names, until the file
is gone or names a later step; what the tests use to act on a run at a known point."""

from __future__ import annotations

import os
import threading
import time

from ray_job.train.hold import HELD, Hold


def _held(path, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while not (held := path.with_name(path.name + HELD)).exists():
        assert time.monotonic() < deadline, "never held"
        time.sleep(0.02)
    epoch, step, pid = held.read_text().split()
    assert int(pid) == os.getpid()
    return f"{epoch} {step}"


def _holding(hold: Hold, epoch: int, step: int) -> threading.Thread:
    t = threading.Thread(target=hold.after_step, args=(epoch, step), daemon=True)
    t.start()
    return t


def test_a_hold_waits_at_the_named_step_until_moved_or_removed(tmp_path, monkeypatch):
    path = tmp_path / "hold"
    hold = Hold(str(path))
    hold.after_step(1, 3)  # no file: no hold
    path.write_text("2 5\n")
    hold.after_step(2, 4)  # before the step it names
    waiting = _holding(hold, 2, 5)
    assert _held(path) == "2 5"
    time.sleep(0.3)
    assert waiting.is_alive()
    path.write_text("3 1\n")  # a later step: released here, held there
    waiting.join(5)
    assert not waiting.is_alive() and not path.with_name("hold.held").exists()
    waiting = _holding(hold, 3, 2)  # past the step it names: held as well
    assert _held(path) == "3 2"
    path.unlink()
    waiting.join(5)
    assert not waiting.is_alive() and not path.with_name("hold.held").exists()

    monkeypatch.setenv("RJ_HOLD_FILE", str(path))
    path.write_text("1 1\n")
    Hold.from_env(master_process=False).after_step(9, 9)  # only rank 0 looks
    assert Hold.from_env(master_process=True).path == str(path)
