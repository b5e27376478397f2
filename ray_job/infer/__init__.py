"""The trained model afterwards: `export` (a run's checkpoint as a self-contained torch.export
model) and `predict` (a folder of images classified with Ray Data).

  options  the flags of both commands; no Ray, no torch
  export   model.pt2 + labels.json + model.json from a run's checkpoint
  predict  Ray Data over an actor pool, one model copy per actor; the CSV, images/s, accuracy
"""

from __future__ import annotations


def export_main(argv: list[str]) -> int:
    from .options import parse_export_args

    opts = parse_export_args(argv)  # bad input fails here, before torch is imported
    from .export import main

    return main(opts)


def predict_main(argv: list[str]) -> int:
    from .options import parse_predict_args

    opts = parse_predict_args(argv)
    from .predict import main

    return main(opts)
