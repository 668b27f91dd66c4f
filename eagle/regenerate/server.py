"""`regenerate.backend=server`: the target runs in OpenAI-compatible servers (vLLM, SGLang, llama.cpp's
llama-server, `transformers serve`), this process renders prompts and writes records.

Each conversation is a `ConversationJob` as in the local engine (turn by turn: answer k is generated
from the regenerated answers before it); each turn is one raw-completion request of the prompt
rendered here (`eagle.regenerate.engines` says how each engine is asked and where its token ids are).
The main thread renders, schedules and writes; per server, a pool of `regenerate.requests_per_server`
threads only carries requests (standard library HTTP, no client dependency).

Faults. At start every server must list the model in `/v1/models`, or the run is refused naming the
URL before anything is written. A server that stops answering mid-run (connection refused or reset,
no answer within `regenerate.request_timeout`, HTTP 502/503/504) is dropped: its turns in flight go
back to the front of the queue and the other servers take them (a turn is asked again from the same
prompt, so nothing is written twice or lost). When no server is left the run stops with a
`ServerError` naming each URL and its last error; the records written so far are kept and the same
command resumes. Any other non-2xx answer (a 400 for a prompt longer than the server's context, say)
stops the run at once with the server's URL and the body it answered: asking elsewhere would fail
the same way.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import urlsplit

from tqdm.auto import tqdm

from eagle.config import RegenerateConfig
from eagle.data.harmony import HarmonyRenderer
from eagle.data.records import Conversation
from eagle.errors import ServerError, TargetError
from eagle.regenerate.engines import ENGINES, Answer, Completion, Engine, EngineError, detect_engine
from eagle.regenerate.job import ConversationJob

# Statuses that say the server, not the request, is the problem (a proxy or load balancer in front of
# a dead server, an engine still loading or whose worker died): the server is dropped, not the run.
_GONE_STATUSES = frozenset({502, 503, 504})
_PROBE_TIMEOUT_S = 30.0  # /v1/models answers at once on a live server; a silent address should not stall
_BODY_CHARS = 1000  # of an error answer, in messages


class ServerGone(Exception):
    """The server cannot be reached or says it is unavailable (the reason is the message)."""


def base_url(url: str) -> str:
    """`http://host:port` from what a user may write (`.../`, `.../v1`)."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@cache
def _opener(loopback: bool) -> urllib.request.OpenerDirector:
    # A proxy from the environment (http_proxy) is for the outside world; a server on this machine is
    # asked directly, as no_proxy=localhost would.
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if loopback else urllib.request.build_opener()


def _is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("localhost", "127.0.0.1", "::1")


def _reason(err: BaseException, timeout: float) -> str:
    if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
        return f"no answer within {timeout:g} s"
    reason = getattr(err, "reason", None)
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else f"{type(err).__name__}: {err}"


def http_json(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """GET `url` (body None) or POST `body` as JSON; the parsed JSON answer.

    Raises `ServerGone` when the server cannot be reached, breaks the connection, takes longer than
    `timeout` or answers 502/503/504; `ServerError` (naming the URL and the answer's body) for any other
    non-2xx answer or an answer that is not JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if data is None else "POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with _opener(_is_loopback(url)).open(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode("utf-8", "replace")[:_BODY_CHARS]
        except (OSError, http.client.HTTPException):
            text = ""
        if e.code in _GONE_STATUSES:
            raise ServerGone(f"HTTP {e.code}: {text}") from e
        raise ServerError(f"{url} answered HTTP {e.code} {e.reason}: {text}") from e
    except (OSError, http.client.HTTPException) as e:  # URLError, refused, reset, timeout, torn answer
        raise ServerGone(_reason(e, timeout)) from e
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServerError(f"{url} answered something that is not JSON: {raw[:_BODY_CHARS]!r}") from e


def text_prompt(tokenizer: Any, text: str, ids: list[int]) -> str:
    """The prompt string a server that tokenises it with special tokens added (what engines do with a
    text prompt) turns into `ids`: `text`, or `text` without the BOS the tokenizer adds again."""
    if list(tokenizer(text)["input_ids"]) == ids:
        return text
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and list(tokenizer(text[len(bos) :])["input_ids"]) == ids:
        return text[len(bos) :]
    raise TargetError(
        "a text prompt would reach the server as other token ids than the rendered prompt's (the "
        "tokenizer adds special tokens the chat template does not expect); serve the target with an "
        "engine that takes token ids (vLLM, SGLang, llama.cpp)"
    )


def request_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Seed of one turn's request: a turn asked again (another server) or in a resumed run samples alike
    on engines that honour per-request seeds."""
    digest = hashlib.sha256(f"{seed}\x00{conversation_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF  # 31 bits: every engine's seed type holds it


@dataclass(eq=False)
class _Server:
    url: str
    engine: Engine
    pool: ThreadPoolExecutor | None = None
    busy: int = 0  # requests in flight
    gone: str | None = None  # why it stopped answering
    entries: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models list


class ServerBackend:
    """`regenerate.backend=server` (see the module docstring); passed to `eagle.regenerate.runner.regenerate`."""

    def __init__(self, cfg: RegenerateConfig) -> None:
        self.urls = list(dict.fromkeys(base_url(u) for u in cfg.servers))
        self.servers: list[_Server] = []
        self.model = ""
        self.mismatch_noted = False

    # -- start: who generates ------------------------------------------------------------------------
    def start(self, tokenizer: Any, cfg: RegenerateConfig) -> dict[str, Any]:
        """Ask every server for its models; refuse unreachable servers, an unknown or ambiguous model name,
        and settings an engine cannot express. Returns what the meta file records."""
        if not self.urls:
            raise ServerError("regenerate.backend=server needs regenerate.servers=[http://HOST:PORT,...]")
        servers = [self._probe(url, cfg) for url in self.urls]
        names = {s.url: self._model_name(s, cfg.model) for s in servers}
        if len(set(names.values())) > 1:
            listed = "; ".join(f"{url}: {name}" for url, name in names.items())
            raise ServerError(
                f"the servers serve different models ({listed}); serve one model everywhere, or name "
                "it with regenerate.model=NAME if they list it under several names"
            )
        self.model = next(iter(names.values()))
        for s in servers:
            entry = next(e for e in s.entries if e.get("id") == self.model)
            s.engine = ENGINES[detect_engine(entry) if cfg.server_engine == "auto" else cfg.server_engine]()
            if cfg.top_k > 0 and not s.engine.takes_top_k:
                raise ServerError(
                    f"regenerate.top_k={cfg.top_k}: {s.url} ({s.engine.name}) takes no top_k; use "
                    "top_k=0 or set regenerate.server_engine if the server is vllm/sglang/llama.cpp"
                )
        self.servers = servers
        return {
            "backend": "server",
            "served_model": self.model,
            "server_engine": ",".join(sorted({s.engine.name for s in servers})),
        }

    def _probe(self, url: str, cfg: RegenerateConfig) -> _Server:
        timeout = min(cfg.request_timeout, _PROBE_TIMEOUT_S)
        try:
            listing = http_json(f"{url}/v1/models", None, timeout)
        except ServerGone as e:
            raise ServerError(
                f"regenerate.servers: {url} cannot be reached ({e}); start it, or leave it out of "
                "regenerate.servers. Nothing was written"
            ) from e
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries
        ):
            raise ServerError(f"{url}/v1/models answered no model list: {json.dumps(listing)[:_BODY_CHARS]}")
        return _Server(url, Engine(), entries=entries)

    @staticmethod
    def _model_name(server: _Server, wanted: str | None) -> str:
        ids = [e["id"] for e in server.entries]
        if wanted is not None:
            if wanted not in ids:
                raise ServerError(
                    f"{server.url} does not serve regenerate.model={wanted!r}; it serves: {', '.join(ids) or 'nothing'}"
                )
            return wanted
        if len(ids) != 1:
            raise ServerError(
                f"{server.url} serves {len(ids)} models ({', '.join(ids) or 'none'}); name the target's "
                "with regenerate.model=NAME"
            )
        return ids[0]

    # -- run: schedule turns, fail over ----------------------------------------------------------------
    def run(
        self,
        todo: list[Conversation],
        tokenizer: Any,
        cfg: RegenerateConfig,
        stop_ids: list[int],
        write: Any,
        bar: Any,
        harmony: HarmonyRenderer | None = None,
    ) -> None:
        """Regenerate `todo`, passing each finished record to `write` (on this thread)."""
        if not self.servers:
            self.start(tokenizer, cfg)
        stop_strings = [tokenizer.decode([t], skip_special_tokens=False) for t in stop_ids]
        started, written = time.perf_counter(), 0

        def on_done(record: dict[str, Any]) -> None:
            nonlocal written
            write([record])
            written += 1
            alive = sum(s.gone is None for s in self.servers)
            rate = written / max(time.perf_counter() - started, 1e-9) * 60
            bar.set_postfix_str(f"{rate:.1f} conv/min, {alive}/{len(self.servers)} servers", refresh=False)

        # Two queues: `ready` holds turns whose prompt is rendered (a retried turn, a conversation's next
        # turn), `fresh` the conversations not started. A turn's answer is followed at once by the job's
        # next prompt on this thread, so a finished conversation is written the moment its last answer
        # arrives, even when no server is left to take another turn.
        fresh = deque(ConversationJob(c, tokenizer, cfg, on_done, harmony) for c in todo)
        ready: deque[tuple[ConversationJob, list[int]]] = deque()
        inflight: dict[Future, tuple[ConversationJob, list[int], _Server]] = {}
        for s in self.servers:
            s.pool, s.busy = ThreadPoolExecutor(cfg.requests_per_server, thread_name_prefix="eagle-server"), 0
        try:
            while True:
                self._fill(ready, fresh, inflight, tokenizer, cfg, stop_ids, stop_strings)
                if not inflight:
                    if ready or fresh:  # turns left and no server to send them to
                        raise self._all_gone()
                    return
                finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for future in finished:
                    if future not in inflight:  # its server was dropped and its turn handed on meanwhile
                        continue
                    job, ids, server = inflight.pop(future)
                    server.busy -= 1
                    try:
                        answer = future.result()
                    except ServerGone as e:
                        ready.appendleft((job, ids))
                        self._drop(server, str(e), ready, inflight)
                        continue
                    except ServerError as e:
                        raise ServerError(f"{e} (conversation {job.id!r}, assistant turn {job.answered + 1})") from e
                    self._finish(job, answer, set(stop_ids))
                    following = job.next_prompt()  # None: the conversation is done and its record written
                    if following is not None:
                        ready.appendleft((job, following))  # its next turn first: conversations finish early
        finally:
            for s in self.servers:
                if s.pool is not None:
                    s.pool.shutdown(wait=False, cancel_futures=True)

    def _fill(
        self,
        ready: deque,
        fresh: deque,
        inflight: dict,
        tokenizer: Any,
        cfg: RegenerateConfig,
        stop_ids: list[int],
        stop_strings: list[str],
    ) -> None:
        """Send the next turns to the least busy servers with a free slot: rendered turns first, then
        conversations not started."""
        while ready or fresh:
            free = [s for s in self.servers if s.gone is None and s.busy < cfg.requests_per_server]
            if not free:
                return
            if ready:
                job, ids = ready.popleft()
            else:
                job = fresh.popleft()
                first = job.next_prompt()  # None: nothing to answer; its record is written
                if first is None:
                    continue
                ids = first
            server = min(free, key=lambda s: s.busy)
            text = job.prompt_text if server.engine.takes_ids else text_prompt(tokenizer, job.prompt_text, ids)
            req = Completion(
                prompt_ids=ids,
                prompt_text=text,
                stop_ids=stop_ids,
                stop_strings=stop_strings,
                max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                seed=request_seed(cfg.seed, job.id, job.answered),
            )
            assert server.pool is not None  # started with the backend
            future = server.pool.submit(self._ask, server, server.engine.body(self.model, req), cfg.request_timeout)
            inflight[future] = (job, ids, server)
            server.busy += 1

    @staticmethod
    def _ask(server: _Server, body: dict[str, Any], timeout: float) -> Answer:
        """One request (on a pool thread): the engine's answer, or `ServerGone` / `ServerError`."""
        url = server.url + server.engine.path
        payload = http_json(url, body, timeout)
        try:
            return server.engine.answer(payload)
        except EngineError as e:
            raise ServerError(f"{url} ({server.engine.name}): {e}: {json.dumps(payload)[:_BODY_CHARS]}") from e

    def _finish(self, job: ConversationJob, answer: Answer, stops: set[int]) -> None:
        ids = answer.token_ids
        if ids is None:
            job.finish_text(answer.text)
            return
        if ids and ids[-1] in stops:  # engines differ in whether the stop token is returned; records never hold it
            ids = ids[:-1]
        # The text is the ids' decoding, as the local engine writes it; a server text that differs means
        # target.path's tokenizer is not the served model's.
        job.finish_answer(ids, keep_ids=True)
        if (
            not self.mismatch_noted
            and job.tokenizer.decode(ids, skip_special_tokens=True).strip() != answer.text.strip()
        ):
            self.mismatch_noted = True
            tqdm.write(
                f"eagle-regenerate: warning: a server's answer text differs from the decoding of its token ids "
                f"(conversation {job.id!r}); is target.path the served model's tokenizer?",
                file=sys.stderr,
            )

    def _drop(self, server: _Server, reason: str, ready: deque, inflight: dict) -> None:
        """Take `server` out of the run; its turns still in flight go back to the front of the queue (those
        it has answered already stay: the loop takes their answers)."""
        if server.gone is not None:
            return
        server.gone = reason
        for future, (job, ids, owner) in list(inflight.items()):
            if owner is server and not future.done():
                del inflight[future]
                server.busy -= 1
                ready.appendleft((job, ids))
        if server.pool is not None:
            server.pool.shutdown(wait=False, cancel_futures=True)
        alive = [s.url for s in self.servers if s.gone is None]
        if alive:
            tqdm.write(
                f"eagle-regenerate: {server.url} stopped answering ({reason}); its conversations go to "
                f"{', '.join(alive)}",
                file=sys.stderr,
            )

    def _all_gone(self) -> ServerError:
        lines = "; ".join(f"{s.url} ({s.gone})" for s in self.servers)
        return ServerError(
            f"every server stopped answering: {lines}. The records written so far are kept: start the "
            "servers again (or list running ones in regenerate.servers) and run the same command to resume"
        )
