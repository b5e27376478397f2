"""Leaf helpers every layer may use, with no Ray and no torch: errors, exit codes, strict JSON,
paths, and the dataclass-to-flags generator."""
