"""Thin Hydra entry points, one module per stage (`eagle-capture`, `eagle-train`, ...)."""
