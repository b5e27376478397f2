"""What a --model name says before torch is imported: the user's own function, the ResNet family (the
models with a stem to swap), a transformer (AdamW by default), and the LR each optimizer starts from."""

from __future__ import annotations

# Transformers, which want AdamW (--optimizer auto), by name prefix (torchvision's builders and classes).
TRANSFORMERS = ("vit_", "swin", "maxvit", "VisionTransformer", "SwinTransformer", "MaxVit")
# The LR of --lr 0 (auto) for a global batch of --lr-ref-batch, by optimizer.
AUTO_LR = {"sgd": 0.1, "adamw": 1e-3}


def is_user_model(model: str) -> bool:
    """--model names the user's own function (pkg.module:fn, ./file.py:fn), not torchvision's."""
    return ":" in model


def is_resnet_family(model: str) -> bool:
    """torchvision's ResNet, Wide-ResNet and ResNeXt: the models with a stem to swap."""
    return model.startswith(("resnet", "wide_resnet", "resnext", "ResNet"))


def is_transformer(model: str) -> bool:
    return model.startswith(TRANSFORMERS)


def model_label(model: str) -> str:
    """The model in a run's default name: the user's `./nets/mine.py:build` as mine_build."""
    if not is_user_model(model):
        return model
    target, _, fn = model.rpartition(":")
    return f"{target.removesuffix('.py').replace('/', '.').rsplit('.', 1)[-1]}_{fn}"
