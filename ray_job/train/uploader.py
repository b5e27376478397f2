"""Asynchronous checkpoints: the step waits only for a snapshot of the training state in host
memory; a thread writes, uploads and verifies it while training goes on.

`snapshot(state)` copies every tensor off the live model and optimizer: on the CPU a clone, on a
GPU into pinned host memory with non-blocking copies on the current stream, which the thread waits
for (an event) before it reads them. The GPU's queue never drains for a checkpoint, and the next
optimizer step cannot change what is being saved. `Upload` runs one job on a thread and keeps its
result; the checkpointer starts a new one only after the previous one was reported, so at most one
upload is in flight and at most one snapshot is held besides the live state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, Optional, TypeVar

import torch

T = TypeVar("T")


class Snapshot:
    """A copy of a checkpoint's state, complete once `wait()` returns."""

    def __init__(self, state: Any):
        self._event: Optional[torch.cuda.Event] = None
        self.state = self._copy(state)
        if self._event is not None:
            self._event.record()

    def _copy(self, obj: Any) -> Any:
        if torch.is_tensor(obj):
            if obj.is_cuda:
                if self._event is None:
                    self._event = torch.cuda.Event()
                host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
                host.copy_(obj.detach(), non_blocking=True)
                return host
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v) for v in obj)
        return obj  # numbers, strings, the config: never changed in place by training

    def wait(self) -> Any:
        """The copied state, once the device has finished copying it."""
        if self._event is not None:
            self._event.synchronize()
        return self.state


def snapshot(state: Any) -> Snapshot:
    return Snapshot(state)


class Upload(Generic[T]):
    """`job()` on a background thread; `result()` waits for it and returns what it returned (or
    raises what it raised)."""

    def __init__(self, job: Callable[[], T], name: str = "checkpoint-upload"):
        self._result: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], T]) -> None:
        try:
            self._result = job()
        except BaseException as e:  # handed to whoever asks for the result
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
