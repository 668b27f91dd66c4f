"""One rank of `tests/test_shard.py`'s family check, run under `torch.distributed.run` (gloo, CPU).

    python -m torch.distributed.run --nproc_per_node 2 -m tests.support.shard_worker TARGETS_DIR OUT_DIR FAMILY...

For each family: the target folder TARGETS_DIR/FAMILY loaded whole (`load_target`) and as FSDP2 shards
(`load_sharded_target`); every rank computes the features of the same padded batch both ways (the same
forwards on every rank). Each rank writes OUT_DIR/rank-R.json: per family whether the features are
bitwise equal, whether a gathered layer equals the whole target's, whether the layer weights are really
sharded, and whether tied embeddings stayed tied.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from eagle.capture.features import extract_features
from eagle.capture.runner import pad_batch
from eagle.config import TargetConfig
from eagle.heads.target_layer import pick_target_layer
from eagle.target.loading import load_target
from eagle.target.shard import gathered, is_sharded, load_sharded_target
from tests.support.capture import make_convs


def check_family(folder: Path) -> dict[str, bool | int]:
    cfg = TargetConfig(path=str(folder), dtype="float32")
    whole, _, _ = load_target(cfg, device="cpu")
    sharded, _, info = load_sharded_target(TargetConfig(path=str(folder), dtype="float32", shard="fsdp"), "cpu")
    ids, mask = pad_batch([c.input_ids for c in make_convs(3, seed=5, vocab=200)])
    aux = [1, 2, 3]
    a, b = extract_features(whole, ids, mask, aux), extract_features(sharded, ids, mask, aux)
    _, whole_layer = pick_target_layer(whole, -1)
    _, layer = pick_target_layer(sharded, -1)
    sharded_weight = next(layer.parameters())
    with gathered(layer):
        same_layer = all(torch.equal(p, q) for p, q in zip(layer.parameters(), whole_layer.parameters(), strict=True))
    again = extract_features(sharded, ids, mask, aux)  # a forward after the gathered read
    tied = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    return {
        "features_equal": all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b),
        "features_equal_after_gather": all(torch.equal(a[k], again[k]) for k in a),
        # float32 rounding only (Qwen3-Next's grouped expert products round differently over gathered weights)
        "features_close": all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-5) for k in a) and set(a) == set(b),
        "features_close_after_gather": all(torch.allclose(a[k], again[k], rtol=1e-5, atol=1e-5) for k in a),
        "gathered_layer_equal": same_layer,
        "layer_sharded": isinstance(sharded_weight, DTensor)
        and sharded_weight.to_local().numel() < sharded_weight.numel(),
        "is_sharded": is_sharded(sharded) and not is_sharded(whole),
        "tie_kept": tied == (sharded.get_output_embeddings().weight is sharded.get_input_embeddings().weight),
        "lm_head_equal": torch.equal(whole.get_output_embeddings().weight, sharded.get_output_embeddings().weight),
        "info_shard": info.shard == "fsdp",
    }


def main() -> None:
    targets, out, families = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    results = {family: check_family(targets / family) for family in families}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
