"""`train.mode=stream`'s splits: the data stage's conversations, features from checked vLLM servers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle.capture.features import extract_features
from eagle.capture.vllm_engine import FinalNorm
from eagle.config import ConfigError, RootConfig
from eagle.data.dataset import build_splits
from eagle.errors import ServerError
from eagle.regenerate.server import ServerGone, base_url
from eagle.target.loading import TargetInfo
from eagle.target.precision import DTYPES
from eagle.target.shard import is_sharded
from eagle.train.stream.client import PROBE_TOKENS, FeatureClient, StreamRecipe
from eagle.train.stream.launch import recipe_for, storage_dir
from eagle.train.stream.pool import StatesPool
from eagle.train.stream.split import StreamSplit
from eagle.train.stream.transport import SharedFileTransport, TransportGone

UNSERVABLE_LEDGER = "stream_unservable.jsonl"  # in output_dir


def probe_tokens(conversations: list[Any]) -> list[int]:
    """PROBE_TOKENS ids from the training data (the first conversation's, repeated if it is shorter)."""
    ids = [int(t) for t in conversations[0].input_ids]
    return (ids * (PROBE_TOKENS // max(len(ids), 1) + 1))[:PROBE_TOKENS]


def local_reference(target: nn.Module, layer_ids: list[int] | None) -> Callable[[list[int]], dict[str, torch.Tensor]]:
    """This process's own features of a probe: {"final_hidden": [N, H], "aux_hidden": [N, 3, H]}."""

    def features(ids: list[int]) -> dict[str, torch.Tensor]:
        device = next(target.parameters()).device
        x = torch.tensor([ids], dtype=torch.long, device=device)  # [1, N]
        out = extract_features(target, x, torch.ones_like(x), layer_ids)
        return {k: v[0].float().cpu() for k, v in out.items()}

    return features


def check_servers(client: FeatureClient, urls: list[str], probe: list[int], reference: Any) -> None:
    """Refuse the run (ServerError, exit status 2) unless every server answers and serves this recipe."""
    for url in urls:
        try:
            client.check_server(url, probe, reference)
        except (ServerGone, TransportGone) as e:
            raise ServerError(
                f"train.stream.urls: {url} cannot be used ({e}); start it with the command "
                "`python -m eagle.cli.serve_target` prints for this recipe, or leave it out. Nothing was trained"
            ) from e


def build_stream_splits(
    cfg: RootConfig,
    target: nn.Module,
    tokenizer: Any,
    info: TargetInfo,
    accelerator: Any,
    log: Callable[[str], None] = print,
) -> tuple[StreamSplit, StreamSplit | None, StreamRecipe]:
    """(training split, held-out split or None, the recipe) with every server of train.stream.urls checked."""
    s = cfg.train.stream
    urls = list(dict.fromkeys(base_url(u) for u in s.urls))
    if not urls:
        raise ConfigError(
            "train.mode=stream needs train.stream.urls=[http://HOST:PORT,...]: vLLM servers started with "
            "`python -m eagle.cli.serve_target` (same recipe)"
        )
    with accelerator.main_process_first():
        splits = build_splits(cfg.data, tokenizer, progress=accelerator.is_main_process)
    with_images = [c.id for c in (*splits.train, *splits.heldout) if getattr(c, "images", ())]
    if with_images:  # the server is sent token ids: an image's pixels would never reach the target
        raise ConfigError(
            f"train.mode=stream sends token ids to vLLM, but {len(with_images)} conversation(s) of {cfg.data.path} hold "
            f"images (first: {with_images[0]!r}); train a vision-language target with train.mode=online or from "
            "an eagle-capture capture. Nothing was trained"
        )
    recipe = recipe_for(cfg, info, target.config)
    transport = SharedFileTransport(storage_dir(cfg))
    # What a trainer killed mid-run left behind: no live request waits twice the timeout.
    swept = transport.sweep(older_than_s=2 * s.request_timeout) if accelerator.is_main_process else 0
    if swept:
        log(
            f"eagle-train: removed {swept} states file(s) older than 2 x train.stream.request_timeout from {transport.root}"
        )
    norm = FinalNorm(cfg.target, info.resolved, DTYPES[info.dtype])
    client = FeatureClient(recipe, transport, norm, s.request_timeout)
    reference = None if is_sharded(target) else local_reference(target, recipe.aux_layer_ids)
    check_servers(client, urls, probe_tokens(list(splits.train)), reference)
    if accelerator.is_main_process:
        log(
            f"eagle-train: streaming features from {len(urls)} server(s) ({', '.join(urls)}), served name "
            f"{recipe.served_name}, states through {storage_dir(cfg)}"
        )
    pool = StatesPool(
        urls,
        client.fetch,
        lambda url: client.check_server(url, probe_tokens(list(splits.train)), None),
        s.requests_per_server,
        s.prefetch,
        s.wait_s,
        log=log if accelerator.is_main_process else (lambda _m: None),
    )
    ledger = Path(cfg.output_dir) / UNSERVABLE_LEDGER  # every rank appends its own lines
    shape = (cfg.train.max_length, info.hidden_size, len(recipe.aux_layer_ids or []))
    train = StreamSplit(splits.train, cfg.capture.shard_size, pool, *shape, ledger=ledger)
    held = StreamSplit(splits.heldout, cfg.capture.shard_size, pool, *shape) if splits.heldout else None
    return train, held, recipe
