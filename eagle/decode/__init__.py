"""Lossless tree speculative decoding with an EAGLE draft head (see `generator.SpeculativeGenerator`)."""

from eagle.decode.accept import accept_tree, process_logits, target_choices
from eagle.decode.autotree import choose_tree_size, expected_tokens, time_verify_passes
from eagle.decode.generator import GenerationResult, SpeculativeGenerator, Timings, autoregressive_generate
from eagle.decode.tree import Tree, compile_static_tree, retrieval_paths, tree_mask

__all__ = [
    "GenerationResult",
    "SpeculativeGenerator",
    "Timings",
    "Tree",
    "accept_tree",
    "autoregressive_generate",
    "choose_tree_size",
    "compile_static_tree",
    "expected_tokens",
    "process_logits",
    "retrieval_paths",
    "target_choices",
    "time_verify_passes",
    "tree_mask",
]
