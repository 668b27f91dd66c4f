"""One server, one sample: ask a vLLM server for a conversation's hidden states, check them, map them.

A request is a raw completion of the conversation's own token ids with `max_tokens=1` (vLLM computes
the prompt, samples one token and stops); vLLM's `extract_hidden_states` method and the hidden-states
connector the server was started with (`eagle.train.stream.launch`) store the prompt's states and the
answer names them in `kv_transfer_params["hidden_states_path"]`. The transport fetches them, and every
answer is checked before use: token ids equal to those sent, one row per token, the engine layers the
recipe asks for, the hidden size, finite values. The engine's layers become eagle's features exactly as
`capture.backend=vllm` maps them (`engine_layer_ids`, `map_engine_states`, `FinalNorm`).

`StreamRecipe.served_name` is how a server declares what it serves: the launcher starts it under that
name (target fingerprint, engine layer ids, dtype, max_model_len), and `check_server` refuses a server
whose `/v1/models` lists another, naming each field that differs, then probes it (prefix caching off,
the states' layers against this process's own target where it holds it whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle.capture.vllm_engine import engine_layer_ids, map_engine_states
from eagle.errors import ServerError
from eagle.regenerate.server import http_json
from eagle.train.stream.transport import StatesTransport, TransportGone

NAME_PREFIX = "eagle-stream"
PROBE_TOKENS = 48  # > vLLM's block size (16): a cached prefix would show as missing rows on the second probe
_PROBE_TIMEOUT_S = 120.0
_PROMPT_REFUSED = (400, 413, 422)  # HTTP statuses that refuse the request itself, not the server


class Unservable(Exception):
    """This sample cannot be served (a prompt the server refuses, non-finite states); the message says why.
    Counted and reported, never skipped silently."""


class AnswerMismatch(ServerError):
    """A server answered states that do not belong to the request (other tokens, rows, layers): it serves
    another model or was started otherwise. The message names the server and what differs."""


@dataclass(frozen=True)
class StreamRecipe:
    """What every server must serve, from the trainer's config (`train.mode=stream`)."""

    model: str  # the folder or Hub id vLLM loads (the target resolved)
    fingerprint: str  # the target's content fingerprint
    aux_layer_ids: list[int] | None  # eagle's aux layers, in draft.aux_layer_ids order (None: final only)
    num_layers: int
    hidden_size: int
    dtype: str  # float32 | bfloat16 | float16
    max_model_len: int  # train.max_length + the one sampled token

    @property
    def layer_ids(self) -> list[int]:
        """vLLM's `eagle_aux_hidden_state_layer_ids`: the aux ids and L, sorted (`engine_layer_ids`)."""
        return engine_layer_ids(self.aux_layer_ids, self.num_layers)

    @property
    def served_name(self) -> str:
        """The `--served-model-name` the launcher gives: every setting a trainer must agree on."""
        layers = "-".join(str(i) for i in self.layer_ids)
        return f"{NAME_PREFIX}/{self.fingerprint[:16]}/layers-{layers}/{self.dtype}/len-{self.max_model_len}"


def name_fields(name: str) -> dict[str, str] | None:
    """{target, layers, dtype, max_model_len} of a served name the launcher gave, None for any other name."""
    parts = name.split("/")
    if len(parts) != 5 or parts[0] != NAME_PREFIX:
        return None
    return {
        "target fingerprint": parts[1],
        "engine layer ids": parts[2].removeprefix("layers-").replace("-", ","),
        "dtype": parts[3],
        "max_model_len": parts[4].removeprefix("len-"),
    }


def name_differences(listed: list[str], recipe: StreamRecipe) -> str:
    """What differs between the served names a server lists and the recipe's, in words."""
    ours = name_fields(recipe.served_name)
    assert ours is not None
    theirs = [f for f in (name_fields(n) for n in listed) if f is not None]
    if not theirs:
        return (
            f"it serves {listed} and none was started by eagle's launcher (served name {recipe.served_name!r}: "
            "extract_hidden_states with this recipe's layers, dtype and max_model_len)"
        )
    return "; ".join(f"{k}: {v} there, {ours[k]} here" for k, v in theirs[0].items() if v != ours[k])


def completion_body(recipe: StreamRecipe, token_ids: list[int]) -> dict[str, Any]:
    """The `/v1/completions` request of one sample: its ids as the prompt, one greedy token."""
    return {"model": recipe.served_name, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}


def check_states(url: str, recipe: StreamRecipe, states: torch.Tensor, tokens: torch.Tensor, sent: list[int]) -> None:
    """Refuse states that are not the answer to `sent` (AnswerMismatch) or are not finite (Unservable).

    states [N, K, H], tokens [N]."""
    got = [int(t) for t in tokens.tolist()]
    if got != sent:
        at = next((i for i, (a, b) in enumerate(zip(got, sent, strict=False)) if a != b), min(len(got), len(sent)))
        raise AnswerMismatch(
            f"{url} answered states for other token ids than were sent ({len(got)} tokens, {len(sent)} sent, "
            f"first difference at position {at}): it serves another tokenizer or model, or prefix caching is on"
        )
    k, h = len(recipe.layer_ids), recipe.hidden_size
    if states.dim() != 3 or tuple(states.shape) != (len(sent), k, h):
        raise AnswerMismatch(
            f"{url} answered hidden states of shape {tuple(states.shape)}; this trainer needs "
            f"[{len(sent)} tokens, {k} layers {recipe.layer_ids}, {h}]: the server extracts other layers "
            "or serves another model"
        )
    if not torch.isfinite(states).all():
        bad = int((~torch.isfinite(states)).any(dim=(1, 2)).sum())
        raise Unservable(f"{bad} of its {len(sent)} tokens have non-finite hidden states in {recipe.dtype}")


class FeatureClient:
    """Requests, transports, checks and maps one sample's states (thread-safe: no mutable state)."""

    def __init__(
        self,
        recipe: StreamRecipe,
        transport: StatesTransport,
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        timeout: float,
    ) -> None:
        self.recipe = recipe
        self.transport = transport
        self.final_norm = final_norm  # [N, H] -> [N, H]: the target's own final norm (FinalNorm)
        self.timeout = timeout

    def engine_states(self, url: str, token_ids: list[int], timeout: float | None = None) -> torch.Tensor:
        """[N, K, H] checked engine states of `token_ids` from `url`.

        Raises ServerGone / TransportGone (the server, not the sample, is the problem), Unservable (the
        server refused the prompt, or non-finite states) or AnswerMismatch / ServerError (a server that
        serves something else)."""
        try:
            answer = http_json(
                f"{url}/v1/completions", completion_body(self.recipe, token_ids), timeout or self.timeout
            )
        except ServerError as e:
            # 400 / 413 / 422 for this prompt (longer than the server's context, say): every server of the same
            # recipe answers it the same way. Any other status (404: the served name is gone) is the server's.
            if getattr(e.__cause__, "code", None) in _PROMPT_REFUSED:
                raise Unservable(str(e)) from e
            raise
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        handle = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(handle, str) or not handle:
            raise ServerError(
                f"{url} answered a completion without kv_transfer_params.hidden_states_path: it does not extract "
                "hidden states (start it with python -m eagle.cli.serve_target: extract_hidden_states and eagle's "
                "connector)"
            )
        try:
            got = self.transport.fetch(handle)
        finally:
            with contextlib.suppress(TransportGone):  # a handle outside the storage folder is never deleted
                self.transport.release(handle)
        check_states(url, self.recipe, got.hidden_states, got.token_ids, token_ids)
        return got.hidden_states

    def features(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Engine states [N, K, H] -> {"final_hidden": [N, H], "aux_hidden": [N, 3, H]} in float32, as
        capture.backend=vllm computes them (the final norm applied in the engine's dtype)."""
        r = self.recipe
        aux, last = map_engine_states(states, r.aux_layer_ids, r.num_layers)  # [N, 3, H] | None, [N, H]
        out = {"final_hidden": self.final_norm(last).float()}
        if aux is not None:
            out["aux_hidden"] = aux.float()
        return out

    def fetch(self, url: str, token_ids: list[int]) -> dict[str, torch.Tensor]:
        """One sample's features from `url` (see `engine_states` for what it raises)."""
        return self.features(self.engine_states(url, token_ids))

    # -- start-up checks ---------------------------------------------------------------------------------
    def check_server(
        self,
        url: str,
        probe: list[int],
        reference: Callable[[list[int]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Refuse (ServerError, naming `url` and what differs) a server that is not this recipe's: its
        `/v1/models` name, then two probes of `probe` (the rows of both: prefix caching off), then, with
        `reference` (this process's own features of `probe`), each layer's values.

        Raises ServerGone when the server does not answer."""
        listing = http_json(f"{url}/v1/models", None, min(self.timeout, 30.0))
        entries = listing.get("data") if isinstance(listing, dict) else None
        names = [str(e["id"]) for e in entries or [] if isinstance(e, dict) and isinstance(e.get("id"), str)]
        if self.recipe.served_name not in names:
            raise ServerError(
                f"train.stream.urls: {url} does not serve this recipe: {name_differences(names, self.recipe)}. "
                "Start it with the command `python -m eagle.cli.serve_target` prints for this recipe"
            )
        timeout = max(self.timeout, _PROBE_TIMEOUT_S)
        for attempt in (1, 2):
            try:
                states = self.engine_states(url, probe, timeout)
            except Unservable as e:
                raise ServerError(f"train.stream.urls: {url} refused the probe request ({e})") from e
            except AnswerMismatch as e:
                hint = " (the second identical request: prefix caching is on)" if attempt == 2 else ""
                raise ServerError(f"train.stream.urls: {e}{hint}") from e
        if reference is not None:
            self._compare(url, states, reference(probe))

    def _compare(self, url: str, states: torch.Tensor, ours: dict[str, torch.Tensor]) -> None:
        """The probe's features from the server against this process's own target (relative max difference)."""
        theirs = self.features(states)
        columns: list[tuple[str, torch.Tensor, torch.Tensor]] = [
            ("final state (layer L after the final norm)", theirs["final_hidden"], ours["final_hidden"])
        ]
        for j, layer in enumerate(self.recipe.aux_layer_ids or []):
            columns.append((f"aux layer {layer}", theirs["aux_hidden"][:, j], ours["aux_hidden"][:, j]))
        tolerance = 0.02 if self.recipe.dtype == "float32" else 0.1
        for what, a, b in columns:  # [N, H] each
            a32, b32 = a.float(), b.float()
            rel = float((a32 - b32).abs().max() / b32.abs().max().clamp(min=1e-6))
            if rel > tolerance:
                raise ServerError(
                    f"train.stream.urls: {url} answers states whose {what} differs from this target's (largest "
                    f"difference {rel:.3g} of the largest value, tolerance {tolerance}): it serves another model "
                    "or other layers than its name says"
                )
