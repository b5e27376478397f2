"""The one typed run configuration (TrainConfig), the decisions made from it and the hardware
(Speed), and the `train` flags generated from its fields."""

from .parser import build_train_parser, config_from_args, parse_train_args
from .run import DATASETS, RECIPES, RESNETS, STEMS, TrainConfig
from .speed import Speed, choose_use_gpu

__all__ = ["DATASETS", "RECIPES", "RESNETS", "STEMS", "Speed", "TrainConfig", "build_train_parser",
           "choose_use_gpu", "config_from_args", "parse_train_args"]
