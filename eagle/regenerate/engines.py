"""How each serving engine is asked for one completion, and where its answer's token ids are.

Every turn is a raw completion of the prompt rendered here with the chat template capture uses
(`eagle.data.template.render`), never a chat completion: the engine's own template (or its tool and
reasoning parsers) could produce another prompt than the one the training data is rendered with. Each
engine gets the prompt as token ids where it takes them (exactly the ids the local engine would
prefill), the stop tokens as ids where it takes them (as their strings otherwise), and the sampling
settings spelt out (an engine's defaults, e.g. the model's generation_config.json in vLLM, must not
change the answers). Where the engine can return the generated ids, they are asked for:

| engine       | endpoint             | prompt | stop tokens          | generated ids back                      |
|--------------|----------------------|--------|----------------------|-----------------------------------------|
| vllm         | /v1/completions      | ids    | stop_token_ids       | return_token_ids -> choices[0].token_ids |
| sglang       | /v1/completions      | ids    | stop_token_ids       | return_token_ids -> choices[0].token_ids |
| llama.cpp    | /completion (native) | ids    | stop strings (+ EOG) | return_tokens -> tokens                 |
| transformers | /v1/completions      | text   | generation_config    | none: `transformers serve` returns text |
| openai       | /v1/completions      | text   | stop strings         | none                                    |

(vLLM: PR #22587, Aug 2025; SGLang: PR #30917, Jul 2026; an older server ignores the field and the
record keeps the text alone. llama.cpp's /v1/completions answer carries no ids, its /completion does.)

The engine is read from `/v1/models` (`owned_by`: vllm, sglang, llamacpp; `transformers serve` lists
its models with a `status` object) unless `regenerate.server_engine` names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completion:
    """One turn to generate, whatever the engine."""

    prompt_ids: list[int]
    prompt_text: str  # for engines that take text: tokenises (special tokens added) to `prompt_ids`
    stop_ids: list[int]
    stop_strings: list[str]
    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # 0 = off
    seed: int


@dataclass(frozen=True)
class Answer:
    """What the engine generated: its text, and its token ids where the engine returns them."""

    text: str
    token_ids: list[int] | None


class EngineError(ValueError):
    """An answer that does not have the fields its engine documents."""


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    return None


def _choice(payload: Any) -> dict[str, Any]:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if (
        not isinstance(choices, list)
        or not choices
        or not isinstance(choices[0], dict)
        or not isinstance(choices[0].get("text"), str)
    ):
        raise EngineError("no choices[0].text in the answer")
    return choices[0]


class Engine:
    """Plain OpenAI completions: a text prompt, stop strings, no top_k, no token ids back."""

    name = "openai"
    path = "/v1/completions"
    takes_ids = False  # the prompt goes as text (`Completion.prompt_text`)
    takes_top_k = False

    def body(self, model: str, req: Completion) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": req.prompt_text,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
        }
        if req.stop_strings:
            body["stop"] = req.stop_strings
        return body

    def answer(self, payload: Any) -> Answer:
        return Answer(_choice(payload)["text"], None)


class VLLMEngine(Engine):
    """vLLM's /v1/completions: token-id prompts, stop token ids, and the generated ids with
    `return_token_ids` (an older vLLM ignores the field: text only then)."""

    name = "vllm"
    takes_ids = True
    takes_top_k = True

    def body(self, model: str, req: Completion) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": req.prompt_ids,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k if req.top_k > 0 else -1,  # -1: off in every version
            # Spelt out: the server's defaults (the model's generation_config.json) would apply otherwise.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "seed": req.seed,
            "stop_token_ids": req.stop_ids,
            "skip_special_tokens": True,
            "return_token_ids": True,
        }

    def answer(self, payload: Any) -> Answer:
        choice = _choice(payload)
        return Answer(choice["text"], _ids(choice.get("token_ids")))


class SGLangEngine(VLLMEngine):
    """SGLang's /v1/completions takes the same fields (`return_token_ids` -> choices[0].token_ids)."""

    name = "sglang"


class LlamaCppEngine(Engine):
    """llama.cpp's llama-server through its native /completion: its /v1/completions answer carries no
    token ids, /completion does with `return_tokens`. A token-id prompt gets no BOS added; generation
    stops at the model's end-of-generation tokens, and at the stop strings."""

    name = "llama.cpp"
    path = "/completion"
    takes_ids = True
    takes_top_k = True

    def body(self, model: str, req: Completion) -> dict[str, Any]:
        # `model` routes the request in router mode (several models); a one-model server ignores it.
        return {
            "model": model,
            "prompt": req.prompt_ids,
            "n_predict": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,  # 0: off
            # llama.cpp's defaults (min_p 0.05, top_k 40) would change the sampling otherwise.
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "seed": req.seed,
            "stop": req.stop_strings,
            "return_tokens": True,
        }

    def answer(self, payload: Any) -> Answer:
        if not isinstance(payload, dict) or not isinstance(payload.get("content"), str):
            raise EngineError("no 'content' in the answer")
        ids = _ids(payload.get("tokens"))
        # An older llama-server leaves `tokens` empty: no ids then, unless nothing was generated.
        return Answer(payload["content"], ids if ids or not payload["content"] else None)


class TransformersEngine(Engine):
    """`transformers serve`: a text prompt (it refuses token ids), which it tokenises adding special
    tokens; no token ids back. Its request schema refuses unknown fields, so stop ids and top_k go in a
    `generation_config` (which replaces the model's own, whose defaults would apply otherwise)."""

    name = "transformers"
    takes_top_k = True  # in the generation_config

    def body(self, model: str, req: Completion) -> dict[str, Any]:
        sample = req.temperature > 0
        generation = {"max_new_tokens": req.max_tokens, "do_sample": sample, "eos_token_id": req.stop_ids}
        if sample:
            generation.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)  # top_k 0: off
        body: dict[str, Any] = {
            "model": model,
            "prompt": req.prompt_text,
            "max_tokens": req.max_tokens,
            "seed": req.seed,
            "generation_config": json.dumps(generation),
        }
        if sample:  # a temperature of 0 in the body only draws a warning: greedy is do_sample=False
            body.update(temperature=req.temperature, top_p=req.top_p)
        return body


ENGINES: dict[str, type[Engine]] = {
    e.name: e for e in (Engine, VLLMEngine, SGLangEngine, LlamaCppEngine, TransformersEngine)
}
_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}


def detect_engine(model_entry: dict[str, Any]) -> str:
    """The engine behind a `/v1/models` entry: by `owned_by`, else `transformers` when the entry has
    `transformers serve`'s `status` object, else plain `openai`."""
    owner = str(model_entry.get("owned_by", "")).lower()
    if owner in _OWNERS:
        return _OWNERS[owner]
    if isinstance(model_entry.get("status"), dict):
        return "transformers"
    return "openai"
