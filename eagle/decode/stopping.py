"""Stop conditions applied to runs of newly accepted tokens (several may arrive at once)."""

from __future__ import annotations

from typing import Any

from eagle.target.structure import config_token_ids


def eos_ids(tokenizer: Any, model: Any | None = None) -> set[int]:
    """EOS ids from the tokenizer and the model's generation_config (which may list several)."""
    return set(config_token_ids(("eos_token_id",), tokenizer, getattr(model, "generation_config", None)))


class StopChecker:
    """Truncates accepted runs at EOS, a stop string or max_new_tokens, and says why it stopped.

    The token completing a stop string (or the EOS token) is kept, as in HF `generate`.
    """

    def __init__(self, tokenizer: Any, eos: set[int], stop_strings: list[str], max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new_tokens = max_new_tokens
        # Tokens of context to re-decode when looking for a stop string spanning token boundaries:
        # every token decodes to at least one byte, and a character is at most 4 bytes.
        self._window = 4 * max((len(s) for s in self.stop_strings), default=0) + 1
        self.generated: list[int] = []
        self.reason: str | None = None

    def push(self, tokens: list[int]) -> list[int]:
        """Append a run of accepted tokens; return the part that is emitted (possibly truncated)."""
        out: list[int] = []
        for tok in tokens:
            self.generated.append(tok)
            out.append(tok)
            if tok in self.eos:
                self.reason = "eos"
            elif self.stop_strings and self._hits_stop_string():
                self.reason = "stop_string"
            elif len(self.generated) >= self.max_new_tokens:
                self.reason = "max_new_tokens"
            if self.reason is not None:
                break
        return out

    def _hits_stop_string(self) -> bool:
        # Only a stop string ending in the newest token counts; earlier ones were checked before.
        tail = self.generated[-self._window :]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        prev = self.tokenizer.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
        return any(s in text and s not in prev for s in self.stop_strings)

    @property
    def done(self) -> bool:
        return self.reason is not None
