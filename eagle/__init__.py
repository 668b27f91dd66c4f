"""EAGLE-style draft heads for speculative decoding: capture, train, decode, evaluate, export."""

__version__ = "0.1.0"
