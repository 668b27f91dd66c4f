"""Lossless tree speculative decoding (batch size 1) and the plain autoregressive baseline.

One step: the head drafts a tree below the root (the newest accepted token); one target forward
verifies root + tree under the tree mask; `walk_tree` picks the accepted path plus a bonus token;
both KV caches keep only the accepted path; the head commits the accepted tokens with the target
features of that same verify pass, which also gives the hidden state drafting the next tree. With
`decode.lookup_tokens`, a prompt-lookup proposal joins the head's tree before the verify pass
(`eagle.decode.lookup`); the rest of the step is unchanged. Under an approximate `decode.acceptance`
(`eagle.decode.approximate`, never the default) the walk also accepts drafts the target's draw missed;
the output is then NOT lossless, and `GenerationResult.shift` says how far the emitted law moved.

Counting: `target_forwards` counts verify passes (prefill excluded); `accept_lengths[i]` is the number
of tokens step i emitted (accepted drafts + the bonus token), so the mean acceptance length is
mean(accept_lengths) and tokens / target_forwards is the same figure up to the prefill's first token.
Batch size is 1: per-sequence accepted lengths differ, and a batched version would need ragged caches.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from eagle.config import DecodeConfig
from eagle.decode.accept import Acceptance, sample_token, walk_tree, walk_tree_sampled
from eagle.decode.approximate import AcceptanceRule, ShiftStats, walk_tree_approx
from eagle.decode.autotree import (
    AutoTreeState,
    choose_chain_length,
    choose_tree_size,
    expected_chain_tokens,
    expected_tokens,
    time_verify_passes,
    verify_time,
)
from eagle.decode.block import block_pool, sampled_chain
from eagle.decode.cache import StateSnapshot, crop_cache, keep_cache_entries
from eagle.decode.draft import (
    draft_pool,
    draft_sampled_chain,
    draft_static,
    tree_from_pool,
    uses_sampled_drafts,
)
from eagle.decode.lookup import LookupStats, NgramLookup, graft_chain
from eagle.decode.multimodal import VisionTarget, begin_prompt, decoding_target
from eagle.decode.stopping import StopChecker, eos_ids
from eagle.decode.target import new_cache, target_forward, verify_plan
from eagle.decode.tree import Tree, compile_static_tree
from eagle.errors import EagleError
from eagle.heads.base import DraftHead
from eagle.heads.layers import inference_copy, uses_mrope
from eagle.heads.quantize import int8_kind, quantize_head_int8
from eagle.target.multimodal import VisionInputs
from eagle.target.precision import dtype_name, resolve_draft_dtype, resolve_draft_weights

log = logging.getLogger(__name__)


@dataclass
class Timings:
    prefill_s: float = 0.0  # target prompt forward (also counted in target_s)
    target_s: float = 0.0  # all target forwards, prefill included
    draft_s: float = 0.0  # all head forwards (commits and drafting)
    # Targets with state layers: forwards that run the accepted tokens again after a partial acceptance
    # (also counted in target_s): what a per-position state (one copy per drafted token) would save.
    replay_s: float = 0.0
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Time spent outside target and head forwards: the decoder's own cost."""
        return self.total_s - self.target_s - self.draft_s


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    target_forwards: int  # decoding target forwards, prefill excluded
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify pass (bonus included)
    accepted_depths: list[int] = field(default_factory=list)  # accepted draft nodes per verify pass
    context_lengths: list[int] = field(default_factory=list)  # tokens read before each verify pass (prompt + new)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified per pass (grafted included)
    lookup_nodes: list[int] = field(default_factory=list)  # prompt-lookup nodes grafted per pass
    lookup_accepted: list[int] = field(default_factory=list)  # of those, accepted per pass
    # Hybrid targets: target forwards that replayed the accepted tokens after a partial acceptance (their
    # time is in timings.target_s; they are not verify passes, so not in target_forwards).
    replays: int = 0
    timings: Timings = field(default_factory=Timings)
    stop_reason: str = "max_new_tokens"  # eos | stop_string | max_new_tokens
    # Distance of the emitted law from the target's over the verified positions (0 under exact acceptance).
    shift: ShiftStats = field(default_factory=ShiftStats)


def _as_ids(input_ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise EagleError(f"input_ids has batch size {ids.shape[0]}; the speculative decoder takes one prompt")
        ids = ids[0]
    if ids.numel() == 0:
        raise EagleError("input_ids is empty; give at least one prompt token")
    return ids.to(device)


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


@dataclass
class _Decoding:
    """One generation's state between steps: the caches, the root (the newest accepted token, not yet in the
    target's cache), its position and the hidden state that drafts from it."""

    res: GenerationResult
    stop: StopChecker
    tcache: Any
    hcache: Any
    root: int = 0
    root_pos: int = 0
    root_hidden: torch.Tensor | None = None
    lookup: NgramLookup | None = None


class SpeculativeGenerator:
    """EAGLE tree speculative decoding whose output follows the target's own (greedy or sampled) law, unless
    `decode.acceptance` names an approximate rule (then `GenerationResult.shift` measures the difference)."""

    def __init__(
        self,
        target: Any,
        head: DraftHead,
        tokenizer: Any,
        decode_cfg: DecodeConfig,
        device: torch.device | str | None = None,
    ) -> None:
        self.target = decoding_target(target)  # a vision-language target: its prompt's images and M-RoPE rows
        self.tokenizer = tokenizer
        self.cfg = decode_cfg
        self.device = torch.device(device) if device is not None else _model_device(target)
        self.head = self._prepare_head(head, next(target.parameters()).dtype)
        self.plan = verify_plan(target.config)  # trees or chains, from what the cache layers keep
        self.feature_ids = list(head.feature_layer_ids())
        self.eos = eos_ids(tokenizer, target)
        self.rng = torch.Generator(device=self.device).manual_seed(decode_cfg.seed)
        self.static = compile_static_tree(decode_cfg.static_paths or []) if decode_cfg.tree == "static" else None
        self.block = head.drafts_block  # one pass drafts every depth (DraftHead.draft_block, eagle.decode.block)
        if self.block and self.static is not None:
            raise EagleError(
                f"decode.tree=static fills a tree level by level from an autoregressive head; a "
                f"{head.config.algorithm} head drafts a block at once: use decode.tree=auto or dynamic"
            )
        vd = head.config.draft_vocab_size
        widest = max(self.static.ranks) + 1 if self.static is not None else decode_cfg.tree_top_k
        if widest > vd:
            raise EagleError(
                f"decode tree asks for {widest} children per node but the head's draft vocabulary "
                f"has {vd} tokens; lower decode.tree_top_k or the ranks in decode.static_paths"
            )
        self.verify_times: dict[int, float] | None = None  # auto tree: seconds per verify pass by size
        self._step_fixed_s = 0.0  # auto tree: running mean of per-step head time (same for every size)
        self._auto = AutoTreeState()
        self.sampled = uses_sampled_drafts(decode_cfg)
        self.chain_stats = LookupStats(decode_cfg.tree_depth) if self.sampled else None  # sampled chains
        self._commit_s = 0.0  # running mean of the head's per-step commit time (sampled chain length)
        self.lookup_stats = LookupStats(decode_cfg.lookup_tokens) if decode_cfg.lookup_tokens else None
        self.last_result: GenerationResult | None = None
        self.rule = AcceptanceRule.from_config(decode_cfg)
        self.top_k = decode_cfg.tree_top_k  # children per drafted node
        if not self.plan.trees:
            self._as_chains()

    def _as_chains(self) -> None:
        """A target whose layers read a verify pass in order (a state that follows the sequence) or take
        masks of their own verifies one path: the head's top-1 chain (or its sampled chain), with no
        prompt-lookup branch grafted on."""
        if self.static is not None:
            raise EagleError(
                f"decode.tree=static verifies a tree, but {self.plan.why_chains}, so it verifies one "
                "chain per pass: use decode.tree=auto or dynamic"
            )
        if self.lookup_stats is not None:
            log.info(
                "%s: drafts are verified as chains, without prompt-lookup branches (decode.lookup_tokens=%d not used)",
                self.plan.why_chains,
                self.cfg.lookup_tokens,
            )
            self.lookup_stats = None
        self.top_k = 1

    def _prepare_head(self, head: DraftHead, target_dtype: torch.dtype) -> DraftHead:
        """The head in `decode.draft_dtype`, with int8 linears under `decode.draft_weights=int8` (fbgemm's
        dynamic product) or `int8_weight_only`.

        Drafting at batch 1 is bound by reading the head's weights, so fewer bytes per weight is
        most of what makes it cheap; the target's verify pass still decides every token.
        """
        have = next(head.parameters()).dtype
        held = int8_kind(head)
        if held is not None:  # quantised by the caller: drafts as it is, and the report says how
            if self.cfg.draft_weights not in ("auto", held):
                log.warning(
                    "the draft head passed in already holds %s linears; decode.draft_weights=%s is not applied",
                    held,
                    self.cfg.draft_weights,
                )
            self.draft_weights, self.draft_dtype = held, dtype_name(have)
            return head.eval()
        dtype = resolve_draft_dtype(self.cfg.draft_dtype, target_dtype, self.device)
        self.draft_weights = resolve_draft_weights(self.cfg.draft_weights, dtype, self.device)
        self.draft_dtype = dtype_name(dtype)
        if self.draft_weights in ("int8", "int8_weight_only"):
            weight_only = self.draft_weights == "int8_weight_only"
            log.info(
                "draft head: int8 linears, %s (%s head; was %s)",
                "weight-only kernel" if weight_only else "dynamically quantised activations",
                self.draft_dtype,
                have,
            )
            head = quantize_head_int8(head, dtype, weight_only=weight_only)
        else:
            if have != dtype:
                log.info(
                    "casting the draft head from %s to %s (decode.draft_dtype=%s)", have, dtype, self.cfg.draft_dtype
                )
            head = cast(DraftHead, inference_copy(head, dtype))  # the caller's head keeps its dtype and export names
        return head.eval()

    # --- one step pieces -------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor) -> int:  # [V] logits -> the target's token
        c = self.cfg
        return sample_token(logits, c.temperature, c.top_k, c.top_p, generator=self.rng)

    def _accept(self, tree: Tree, logits: torch.Tensor) -> tuple[Acceptance, ShiftStats]:  # logits: [N + 1, V]
        c = self.cfg
        if not self.rule.lossless:  # top-k trees only: config validation refuses sampled drafts here
            return walk_tree_approx(
                tree.tokens, tree.parents, logits, self.rule, c.temperature, c.top_k, c.top_p, generator=self.rng
            )
        return self._accept_exact(tree, logits), ShiftStats()

    def _accept_exact(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        c = self.cfg
        if tree.draft_probs:
            return walk_tree_sampled(
                tree.tokens, tree.parents, logits, tree.draft_probs, c.temperature, c.top_k, c.top_p, generator=self.rng
            )
        return walk_tree(tree.tokens, tree.parents, logits, c.temperature, c.top_k, c.top_p, generator=self.rng)

    def _draft(self, head_cache, root: int, root_hidden: torch.Tensor | None, root_pos: int):
        c = self.cfg
        if self.block:
            return self._draft_block(head_cache, root, root_hidden, root_pos)
        # An autoregressive (EAGLE) head drafts from the hidden state its last commit returned.
        assert root_hidden is not None
        if self.sampled:
            assert self.chain_stats is not None  # kept whenever drafts are sampled
            depth = c.tree_depth
            if c.tree == "auto":
                depth = choose_chain_length(
                    self.chain_stats, self.verify_times or {}, self._auto.level_s, self._commit_s, c.tree_depth
                )
                self._auto.predicted = expected_chain_tokens(self.chain_stats, depth)[depth]
                self._auto.levels = depth
            return draft_sampled_chain(
                self.head,
                head_cache,
                root,
                root_hidden,
                root_pos,
                depth,
                c.temperature,
                c.top_k,
                c.top_p,
                generator=self.rng,
            )
        if self.static is not None:
            return draft_static(self.head, head_cache, root, root_hidden, root_pos, self.static)
        if c.tree != "auto":
            pool = draft_pool(self.head, head_cache, root_hidden, root_pos, self.top_k, c.tree_depth)
            return tree_from_pool(pool, root, c.tree_total_tokens)
        # Auto: the head's probabilities scaled by how well they predicted acceptance so far; stop
        # drafting deeper when a level cannot pay for itself; keep the size that maximises tokens/s.
        pool = draft_pool(
            self.head, head_cache, root_hidden, root_pos, self.top_k, c.tree_depth, min_gain=self._auto.min_level_gain()
        )
        return self._auto_tree(pool, root)

    def _draft_block(self, head_cache, root: int, root_hidden: torch.Tensor | None, root_pos: int) -> Tree:
        """One head pass gives every block position's law; a sampled chain, or a tree of their top-k."""
        c = self.cfg
        log_probs = self.head.draft_block(head_cache, root, root_hidden, root_pos)  # [D, V] (inference mode)
        if self.sampled:
            return sampled_chain(log_probs, root, c.temperature, c.top_k, c.top_p, generator=self.rng)
        pool = block_pool(log_probs, min(self.top_k, log_probs.shape[-1]))
        if c.tree != "auto":
            return tree_from_pool(pool, root, c.tree_total_tokens)
        return self._auto_tree(pool, root)

    def _auto_tree(self, pool, root: int) -> Tree:
        """Keep the tree size that maximises the expected tokens per second of a step."""
        c = self.cfg
        alpha = self._auto.calibration
        scores = pool.scores.float() + math.log(alpha)
        total = choose_tree_size(
            self.verify_times or {}, scores, default=c.tree_total_tokens, fixed_s=self._step_fixed_s
        )
        self._auto.predicted = expected_tokens(pool.scores, [total])[0] - 1.0
        self._auto.levels = int(pool.depths.max())
        return tree_from_pool(pool, root, total)

    def _graft(self, tree: Tree, chain: list[int]) -> tuple[Tree, int]:
        """Add the prompt-lookup chain to the tree; return it and the number of grafted nodes.

        Under tree=auto only the prefix of the new nodes that raises the expected tokens per second
        is kept: each grafted node adds its measured chance of acceptance (`LookupStats`) and its
        share of a bigger verify pass (`verify_time`)."""
        if not chain:
            return tree, 0
        grafted, positions = graft_chain(tree, chain)
        g = int(positions.numel())
        if g and self.cfg.tree == "auto" and self.verify_times and self.lookup_stats is not None:
            base = 1.0 + self._auto.calibration * self._auto.predicted  # the head's tree, calibrated
            gains = self.lookup_stats.expected(positions)
            s, fixed, times = tree.size, self._step_fixed_s, self.verify_times

            def rate(k: int) -> float:
                return (base + (gains[k - 1] if k else 0.0)) / (verify_time(times, s + k) + fixed)

            g = max(range(g + 1), key=rate)
            n = tree.size + 1 + g
            grafted = Tree(
                tokens=grafted.tokens[:n],
                parents=grafted.parents[:n],
                depths=grafted.depths[:n],
                draft_probs=grafted.draft_probs,
            )
        return grafted, g

    @torch.inference_mode()
    def _commit(
        self, hcache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The head reads the verified tokens' target features [T, k, Ht] at their positions [T] (each
        token of `tokens` [T] is the one after them); returns the hidden state that drafts next (EAGLE),
        or None for a head that keeps only the context (DFlash)."""
        return self.head.commit(hcache, tokens, features, positions)

    def _head_positions(self, start: int, n: int) -> torch.Tensor:
        """The positions the head reads for the target features of sequence indices start .. start + n - 1
        (`DraftHead.commit`): the indices, or on a vision-language target the target's own position rows of
        them as vLLM hands them to its draft (`eagle.algorithms.base.target_positions`): all three M-RoPE
        rows [3, n] for an M-RoPE head, the time row [n] for another."""
        sequence = torch.arange(start, start + n, device=self.device)  # [n]
        if not isinstance(self.target, VisionTarget):
            return sequence
        rows = self.target.positions(sequence)[1:, 0]  # [3, n]
        return rows if uses_mrope(self.head.config) else rows[0]

    def _head_root(self, root_pos: int) -> int:
        """The root's position for drafting (the sequence index of the newest accepted token): past the
        prompt a vision-language target's three rows are all `index + delta`, so one integer says them."""
        return root_pos + self.target.delta if isinstance(self.target, VisionTarget) else root_pos

    def _replay(self, tcache, snapshot: StateSnapshot, accepted: torch.Tensor, root_pos: int) -> float:
        """After a partial acceptance on a target with state layers: states back to before the verify pass,
        keys and values cropped to it, and the accepted path (root first, [m]) run again so that every
        layer holds exactly it. Returns the seconds it took (target time)."""
        t0 = time.perf_counter()
        snapshot.restore()
        crop_cache(tcache, root_pos)
        m = accepted.numel()
        target_forward(
            self.target,
            accepted,
            torch.arange(root_pos, root_pos + m, device=self.device),
            tcache,
            plan=self.plan,
            last_logits_only=True,
        )
        return time.perf_counter() - t0

    def calibrate(self, context_len: int = 128) -> dict[int, float]:
        """Auto tree: time one verify pass per candidate size on this machine (done once)."""
        if self.verify_times is None:
            self.verify_times = time_verify_passes(
                self.target, self.cfg.auto_candidates, context_len, self.plan, self.device
            )
        return self.verify_times

    # --- decoding --------------------------------------------------------------------------------
    def stream(self, input_ids: list[int] | torch.Tensor, vision: VisionInputs | None = None) -> Iterator[list[int]]:
        """Yield the newly accepted tokens of every step; the summary lands in `self.last_result`."""
        if self.cfg.tree == "auto":
            self.calibrate()
        t_start = time.perf_counter()
        prompt = _as_ids(input_ids, self.device)
        begin_prompt(self.target, prompt, vision)  # `vision`: the prompt's images (a vision-language target)
        res = GenerationResult(tokens=[], target_forwards=0)
        self.last_result = res
        run = _Decoding(
            res,
            StopChecker(self.tokenizer, self.eos, self.cfg.stop_strings, self.cfg.max_new_tokens),
            new_cache(self.target.config, self.plan),
            self.head.new_draft_cache(),
        )
        yield self._prefill(run, prompt)
        while not run.stop.done:
            emitted, acc, features = self._step(run)
            yield emitted
            if run.stop.done:
                break
            self._commit_accepted(run, acc, features)
        res.stop_reason = run.stop.reason or "max_new_tokens"
        res.timings.total_s = time.perf_counter() - t_start

    def _prefill(self, run: _Decoding, prompt: torch.Tensor) -> list[int]:
        """The prompt through the target (its first token, the first root) and the head (its context)."""
        res, n = run.res, prompt.numel()
        t0 = time.perf_counter()
        out = target_forward(
            self.target,
            prompt,
            torch.arange(n, device=self.device),
            run.tcache,
            feature_layer_ids=self.feature_ids,
            plan=self.plan,
            last_logits_only=True,
        )
        run.root = self._choose(out.logits[-1])
        res.timings.prefill_s = res.timings.target_s = time.perf_counter() - t0
        emitted = run.stop.push([run.root])
        res.tokens += emitted
        if self.lookup_stats is not None:
            run.lookup = NgramLookup(prompt.tolist() + [run.root], self.cfg.lookup_max_ngram, self.cfg.lookup_min_ngram)
        assert out.features is not None  # asked for: feature_layer_ids
        t0 = time.perf_counter()
        run.root_hidden = self._commit(
            run.hcache,
            torch.cat([prompt[1:], torch.tensor([run.root], device=self.device)]),
            out.features,
            self._head_positions(0, n),
        )
        res.timings.draft_s += time.perf_counter() - t0
        run.root_pos = n  # = target cache length: the root is not yet in it
        return emitted

    def _step(self, run: _Decoding) -> tuple[list[int], Any, torch.Tensor]:
        """Draft, verify and accept once; keep the accepted path in the target's cache. Returns (emitted
        tokens, the acceptance, the verify pass's features)."""
        res, root_pos = run.res, run.root_pos
        t0 = time.perf_counter()
        tree = self._draft(run.hcache, run.root, run.root_hidden, self._head_root(root_pos))
        chain = run.lookup.propose(self.cfg.lookup_tokens) if run.lookup is not None else []
        tree, grafted = self._graft(tree, chain)
        t1 = time.perf_counter()
        snapshot = StateSnapshot.take(run.tcache) if self.plan.holds_state else None
        out = target_forward(
            self.target,
            tree.tokens,
            root_pos + tree.depths,
            run.tcache,
            tree.mask(),
            feature_layer_ids=self.feature_ids,
            plan=self.plan,
        )
        t2 = time.perf_counter()
        acc, shift = self._accept(tree, out.logits)
        shift.positions = len(acc.tokens)  # every reached node emitted one token (exact: shift 0 there)
        res.shift.add(shift)
        if self.chain_stats is not None:  # chain nodes 1..drafted; grafted nodes come after them
            self.chain_stats.observe(tree.tokens[1 : len(tree.draft_probs) + 1].tolist(), acc.tokens)
        if snapshot is not None and acc.nodes.numel() <= tree.size:
            replay_s = self._replay(run.tcache, snapshot, tree.tokens[acc.nodes], root_pos)
            res.timings.replay_s += replay_s
            t2 += replay_s
            res.replays += 1
        else:
            keep_cache_entries(run.tcache, root_pos, acc.nodes)
        emitted = run.stop.push(acc.tokens)
        res.tokens += emitted
        res.target_forwards += 1
        res.accept_lengths.append(len(emitted))
        res.accepted_depths.append(len(acc.tokens) - 1)
        res.context_lengths.append(root_pos)
        res.tree_sizes.append(tree.size)
        accepted_drafts = len(acc.tokens) - 1
        if run.lookup is not None:
            first_grafted = tree.size + 1 - grafted  # grafted nodes are the last ones
            on_graft = int((acc.nodes >= first_grafted).sum()) if grafted else 0
            res.lookup_nodes.append(grafted)
            res.lookup_accepted.append(on_graft)
            if self.lookup_stats is not None:
                self.lookup_stats.observe(chain, acc.tokens)
            run.lookup.extend(acc.tokens)
            accepted_drafts -= on_graft  # the head's calibration counts the head's nodes only
        res.timings.draft_s += t1 - t0
        res.timings.target_s += t2 - t1
        self._step_fixed_s = 0.8 * self._step_fixed_s + 0.2 * (t1 - t0)
        if self.cfg.tree == "auto":
            self._auto.observe(accepted=accepted_drafts, draft_s=t1 - t0, step_s=time.perf_counter() - t0)
        assert out.features is not None  # the verify pass always asks for the head's feature layers
        return emitted, acc, out.features

    def _commit_accepted(self, run: _Decoding, acc: Any, features: torch.Tensor) -> None:
        """The head reads the accepted drafts and the bonus token (the next root) with their target features."""
        t0 = time.perf_counter()
        new = torch.tensor(acc.tokens, device=self.device)  # accepted drafts + bonus
        m = new.numel()
        run.root_hidden = self._commit(run.hcache, new, features[acc.nodes], self._head_positions(run.root_pos, m))
        commit_s = time.perf_counter() - t0
        run.res.timings.draft_s += commit_s
        self._commit_s = commit_s if self._commit_s == 0 else 0.8 * self._commit_s + 0.2 * commit_s
        run.root, run.root_pos = acc.tokens[-1], run.root_pos + m

    def generate(self, input_ids: list[int] | torch.Tensor, vision: VisionInputs | None = None) -> GenerationResult:
        """Decode until EOS, a stop string or max_new_tokens."""
        for _ in self.stream(input_ids, vision):
            pass
        assert self.last_result is not None
        return self.last_result


def autoregressive_generate(
    target: Any,
    tokenizer: Any,
    input_ids: list[int] | torch.Tensor,
    decode_cfg: DecodeConfig,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    vision: VisionInputs | None = None,
) -> GenerationResult:
    """One target forward per token over the same cache and mask code (the eval's baseline); `vision`: the
    prompt's images (a vision-language target)."""
    device = torch.device(device) if device is not None else _model_device(target)
    plan = verify_plan(target.config)
    rng = generator if generator is not None else torch.Generator(device=device).manual_seed(decode_cfg.seed)
    c = decode_cfg
    t_start = time.perf_counter()
    prompt = _as_ids(input_ids, device)
    model = decoding_target(target)
    begin_prompt(model, prompt, vision)
    res = GenerationResult(tokens=[], target_forwards=0)
    stop = StopChecker(tokenizer, eos_ids(tokenizer, target), c.stop_strings, c.max_new_tokens)
    cache = new_cache(target.config, plan)
    ids, pos = prompt, torch.arange(prompt.numel(), device=device)
    while True:
        t0 = time.perf_counter()
        out = target_forward(model, ids, pos, cache, plan=plan, last_logits_only=ids is prompt)
        dt = time.perf_counter() - t0
        tok = sample_token(out.logits[-1], c.temperature, c.top_k, c.top_p, generator=rng)
        res.timings.target_s += dt
        if ids is prompt:
            res.timings.prefill_s = dt
        else:
            res.target_forwards += 1
            res.accept_lengths.append(1)
            res.accepted_depths.append(0)
            res.context_lengths.append(int(pos[0]))
        res.tokens += stop.push([tok])
        if stop.done:
            break
        ids = torch.tensor([tok], device=device)
        pos = pos[-1:] + 1
    res.stop_reason = stop.reason or "max_new_tokens"
    res.timings.total_s = time.perf_counter() - t_start
    return res
