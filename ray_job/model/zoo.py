"""Every model `--model` names: torchvision's image classifiers (by builder, `resnet50`, or by class,
`VisionTransformer`), or the user's own function (`pkg.module:fn`, `./file.py:fn`).

One rule each for what a run's flags mean to a model: `num_classes` is the data's; a model whose
constructor takes the input size (ViT: `image_size`, MaxViT: `input_size`) gets `--image-size`; the
CIFAR stem applies to the ResNet family; `--model-arg KEY=VALUE` are constructor options. `check`
builds the model on the meta device (no memory, no time) and runs a forward pass at the image size,
so a model that cannot take it is refused on the driver, in one line, before any worker starts.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any
from collections.abc import Callable

import torch
import torchvision
from torch import nn

from ..config import TrainConfig
from ..config.families import is_resnet_family, is_user_model
from ..core.errors import UsageError

# Constructor options that carry the input size, by model name prefix (torchvision's own names).
SIZE_ARGS = {"vit_": "image_size", "VisionTransformer": "image_size", "maxvit": "input_size", "MaxVit": "input_size"}
# Image sizes offered when the one asked for does not fit.
TRY_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299, 384)


def classifiers() -> list[str]:
    """The names --model takes from torchvision: its builders, then its model classes."""
    classes = [n for n, v in vars(torchvision.models).items()
               if isinstance(v, type) and issubclass(v, nn.Module) and not n.startswith("_")]
    return torchvision.models.list_models(module=torchvision.models) + sorted(classes)


def model_args(cfg: TrainConfig) -> dict[str, Any]:
    """--model-arg KEY=VALUE as keyword arguments: VALUE as a Python literal (4, 0.1, True, (7, 7)),
    else the string."""
    out = {}
    for item in cfg.model_arg:
        key, _, value = item.partition("=")
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(value)
        out[key.strip()] = value
    return out


def _size_kwargs(name: str, image_size: int) -> dict:
    for prefix, arg in SIZE_ARGS.items():
        if name.startswith(prefix):
            return {arg: image_size if arg == "image_size" else (image_size, image_size)}
    return {}


def user_function(spec: str, code_dir: str) -> Callable[..., nn.Module]:
    """The function of `pkg.module:fn` (imported with `code_dir` on sys.path) or `path/file.py:fn`
    (relative to `code_dir`)."""
    target, _, fn_name = spec.rpartition(":")
    if code_dir and code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in the user's folder
    try:
        if target.endswith(".py"):
            path = os.path.normpath(os.path.join(code_dir, target) if code_dir else target)
            if not os.path.isfile(path):
                raise UsageError(f"--model {spec}: no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"ray_job_user_model_{abs(hash(path))}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except UsageError:
        raise
    except Exception as e:  # the user's code: any error it raises while importing
        raise UsageError(f"--model {spec}: importing {target} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.dont_write_bytecode = writes
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--model {spec}: {target} has no function {fn_name!r}")
    return fn


def build(cfg: TrainConfig, num_classes: int, image_size: int | None = None) -> nn.Module:
    """The untrained model of `cfg` with `num_classes` outputs, for images of `image_size` (default
    --image-size); on the default device (use `with torch.device("meta")` to build it for free)."""
    size = image_size or cfg.image_size
    kwargs = model_args(cfg)
    if is_user_model(cfg.model):
        fn = user_function(cfg.model, cfg.code_dir)
        params = inspect.signature(fn).parameters
        if "image_size" in params:
            kwargs["image_size"] = size
        try:
            model = fn(num_classes=num_classes, **kwargs)
        except TypeError as e:
            raise UsageError(f"--model {cfg.model}: {e}; it must take num_classes (and image_size, "
                             f"if it asks for it), and the --model-arg options") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"--model {cfg.model} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    kwargs = {**_size_kwargs(cfg.model, size), **kwargs, "num_classes": num_classes}
    if cfg.model in ("googlenet", "inception_v3", "GoogLeNet", "Inception3"):
        kwargs.setdefault("aux_logits", False)  # a second output only in training: one loss here
        kwargs.setdefault("init_weights", True)
    if is_resnet_family(cfg.model):
        # every residual branch starts at zero: large-batch training is stable from the first step
        # (Goyal et al., 2017)
        kwargs.setdefault("zero_init_residual", True)
    cls = getattr(torchvision.models, cfg.model, None)
    if isinstance(cls, type):
        model = cls(**kwargs)
    else:
        model = torchvision.models.get_model(cfg.model, weights=None, **kwargs)
    if cfg.stem_in_use == "cifar":
        # 32x32 images lose too much at a stride-2 7x7 conv + max-pool: keep full resolution.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def _options_of(cfg: TrainConfig) -> list[str]:
    """The constructor options of cfg's torchvision model (its class's named parameters)."""
    cls = getattr(torchvision.models, cfg.model, None)
    if not isinstance(cls, type):
        with torch.device("meta"):
            cls = type(build(dataclasses.replace(cfg, model_arg=()), 10))
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name not in ("self", "num_classes")
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _check_args(cfg: TrainConfig) -> None:
    """--model-arg names only options of the model (a class taking **kwargs would swallow others)."""
    if is_user_model(cfg.model) or not cfg.model_arg:
        return
    options = _options_of(cfg)
    unknown = [k for k in model_args(cfg) if k not in options]
    if unknown:
        raise UsageError(f"--model-arg {', '.join(unknown)}: {cfg.model} has no such option; its options: "
                         f"{', '.join(options)}")


def _on_meta(cfg: TrainConfig, num_classes: int, size: int) -> nn.Module:
    """The model built on the meta device and run forward once at `size` (raises what it raises)."""
    try:
        with torch.device("meta"):
            model = build(cfg, num_classes, size)
    except NotImplementedError:  # a constructor that reads its tensors (RegNet): build it for real
        model = build(cfg, num_classes, size)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.eval()(torch.zeros(2, 3, size, size, device=device))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        raise UsageError(f"--model {cfg.model} returns {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))}; a classifier must return logits "
                         f"of shape (batch, {num_classes})")
    return model


def check(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """On the driver: the model on the meta device, or one line saying why `cfg` cannot build it or
    why it cannot take --image-size (naming the sizes that work)."""
    if not is_user_model(cfg.model) and cfg.model not in classifiers():
        raise UsageError(f"--model {cfg.model!r} is not a torchvision image classifier; use one of "
                         f"`python -m ray_job train --help`'s list (resnet50, convnext_tiny, vit_b_16, "
                         f"...), or your own as pkg.module:function or ./file.py:function")
    _check_args(cfg)
    try:
        return _on_meta(cfg, num_classes, cfg.image_size)
    except UsageError:
        raise
    except TypeError as e:  # a constructor's own words: a missing option, or one the builder fixes
        fixed = ("multiple values" in str(e) and not is_user_model(cfg.model)
                 and not isinstance(getattr(torchvision.models, cfg.model, None), type))
        hint = (f"; {cfg.model} fixes it: build the model from its class, --model "
                f"{type(_on_meta(dataclasses.replace(cfg, model_arg=()), num_classes, 224)).__name__} "
                f"with --model-arg for each option" if fixed else "; give each with --model-arg KEY=VALUE"
                if "missing" in str(e) else "")
        raise UsageError(f"--model {cfg.model}: {str(e).split('() ', 1)[-1]}{hint}") from None
    except Exception as e:  # a shape the model cannot take: find the sizes it can
        works = []
        for size in TRY_SIZES:
            with contextlib.suppress(Exception):
                _on_meta(cfg, num_classes, size)
                works.append(str(size))
        hint = (f"--image-size {', '.join(works)} work" if works
                else "no --image-size from 32 to 384 works")
        raise UsageError(f"--model {cfg.model} cannot take --image-size {cfg.image_size} "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); {hint}") from None


def named(model: str, stem: str, num_classes: int) -> nn.Module:
    """A ResNet-family model by name with the given stem, as `train` builds it (benchmarks, the
    raw-DDP baseline's same-model comparison)."""
    return build(TrainConfig(model=model, stem=stem), num_classes)
