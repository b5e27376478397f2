"""--init-weights: start a model from weights the user has (a torchvision weights file, any state
dict, a run's checkpoint.pt), local or on object storage; nothing is downloaded.

A tensor is loaded when the file has one of the same name and shape (after the `module.` and
`_orig_mod.` prefixes of DDP and torch.compile); the rest of the model starts new (a head of
another size: 1000 ImageNet classes, 10 here) and what the file has beyond it is ignored. The driver
checks the file against the model on the meta device before any worker starts.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .. import storage
from ..core.errors import UsageError
from ..storage import StorageError

log = logging.getLogger("ray_job.model")

PREFIXES = ("module.", "_orig_mod.")
WRAPPERS = ("model", "state_dict", "model_state_dict")  # where checkpoints keep the state dict


def read(path: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the weights file at `path` and the file's SHA-256 (its identity in run names)."""
    try:
        data = storage.at(path).read_bytes()
    except (OSError, StorageError) as e:
        raise UsageError(f"--init-weights {path}: cannot read it ({storage.reason(e)})") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle or zip errors of a file that is not torch's
        raise UsageError(f"--init-weights {path} is not a PyTorch weights file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})") from None
    for key in WRAPPERS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise UsageError(f"--init-weights {path} holds a {type(state).__name__}, not a state dict")
    tensors = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            for prefix in PREFIXES:
                name = name.removeprefix(prefix)
            tensors[name] = value
    return tensors, hashlib.sha256(data).hexdigest()


@dataclass
class Fit:
    """What of a weights file fits a model: loaded (same name and shape), new (the model's tensors
    the file has not), ignored (the file's tensors the model has not, or of another shape)."""

    loaded: list[str]
    new: list[str]
    ignored: list[str]

    def line(self) -> str:
        def some(names: list[str]) -> str:
            return ", ".join(names[:6]) + (f", ... ({len(names)})" if len(names) > 6 else "")
        return (f"{len(self.loaded)} tensors loaded, {len(self.new)} new ({some(self.new) or 'none'}), "
                f"{len(self.ignored)} of the file's ignored ({some(self.ignored) or 'none'})")


def fit(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Fit:
    own = model.state_dict()
    loaded = [n for n, t in own.items() if n in tensors and tuple(tensors[n].shape) == tuple(t.shape)]
    taken = set(loaded)
    return Fit(loaded, [n for n in own if n not in taken], [n for n in tensors if n not in taken])


def check(model: nn.Module, path: str) -> tuple[Fit, str]:
    """On the driver: how the file at `path` fits `model` (meta is fine), and the file's SHA-256;
    a file that fits nothing is one line."""
    tensors, digest = read(path)
    found = fit(model, tensors)
    if not set(found.loaded) & {n for n, _ in model.named_parameters()}:  # buffers alone are no fit
        raise UsageError(f"--init-weights {path} fits nothing of this model: none of its "
                         f"{len(tensors)} tensors ({', '.join(list(tensors)[:3])}, ...) has the name and "
                         f"shape of one of the model's ({', '.join(list(model.state_dict())[:3])}, ...); "
                         f"give the weights of the same architecture")
    return found, digest


def load(model: nn.Module, path: str) -> Fit:
    """Loads what fits of the file at `path` into `model` (on the CPU, before it is placed)."""
    tensors, _ = read(path)
    found = fit(model, tensors)
    model.load_state_dict({n: tensors[n] for n in found.loaded}, strict=False)
    log.info("--init-weights %s: %s", path, found.line())
    return found
