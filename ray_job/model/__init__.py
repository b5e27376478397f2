"""The model and how it is optimised: any torchvision image classifier or the user's own (zoo.py), the
optimizer (SGD or AdamW) with parameter groups, and the LR schedule as a pure function of the step."""

from .zoo import build as build_for

__all__ = ["build_for"]
