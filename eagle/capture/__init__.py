"""Hidden-state capture: target features for offline draft-head training.

- `extract_features`: the one target-forward -> features function (capture and online training).
- `capture_splits` / `run_capture`: write sharded safetensors + `manifest.json` (resumable, multi-process).
- `vllm_engine`: `capture.backend=vllm`, the target in vLLM (its own venv, `vllm_worker/`), same shards.
- `CaptureDataset`, `ShardShuffleSampler`, `collate`: read a capture for training.
- `read_manifest`, `check_compatible`: refuse a capture from another target / layer set.
"""

from eagle.capture.features import extract_features
from eagle.capture.reader import CaptureDataset, ShardShuffleSampler, check_compatible, collate
from eagle.capture.runner import capture_splits, run_capture
from eagle.capture.store import read_manifest

__all__ = [
    "CaptureDataset",
    "ShardShuffleSampler",
    "capture_splits",
    "check_compatible",
    "collate",
    "extract_features",
    "read_manifest",
    "run_capture",
]
