"""Samples in flight across the servers: bounded prefetch, failover, backoff, unservable samples.

`StatesPool` keeps up to `prefetch` samples requested or ready ahead of the trainer (in the order the
trainer will take them, as `want` announces it) and at most `requests_per_server` requests in flight on
each server, carried by threads; the trainer's thread only announces and takes. What happens when:

- a server stops answering (connection refused or reset, timeout, 502/503/504, its states unreadable):
  it is dropped, its samples in flight go back to the front of the queue and the other servers take
  them; nothing is lost or trained twice;
- every server is gone: `take` waits, asking the dropped servers again with exponential backoff (1 s,
  2 s, ... at most 30 s apart) for `wait_s`; a server that answers its check again rejoins; after that
  `StreamStopped` (a `TrainingError`) names every URL and its last error;
- a sample cannot be served (the servers refuse its prompt, its states are not finite, or its requests
  broke MAX_SAMPLE_DROPS connections): `take` returns None for it and it is listed in `unservable` (the
  trainer masks it out of its batch and reports it);
- an answer that belongs to another request or model (`AnswerMismatch`, any other `EagleError`): the
  run stops with it at the next `take`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from eagle.errors import TrainingError
from eagle.regenerate.server import ServerGone
from eagle.train.stream.client import Unservable
from eagle.train.stream.transport import TransportGone

Features = dict[str, torch.Tensor]
MAX_BACKOFF_S = 30.0
# A sample whose requests broke this many connections (a server crashed or timed out on it each time) is
# unservable: otherwise one prompt that kills servers, or outlasts the timeout, would cycle through them forever.
MAX_SAMPLE_DROPS = 3


class StreamStopped(TrainingError):
    """Every server of train.stream.urls stopped answering and none came back within train.stream.wait_s."""


@dataclass(frozen=True)
class Sample:
    """One request: `key` names it (the same conversation and tokens give the same key), `token_ids` are sent."""

    key: str
    token_ids: list[int]
    label: str  # the conversation id, for messages and the report


@dataclass
class _Server:
    url: str
    busy: int = 0  # requests in flight
    served: int = 0
    gone: str | None = None  # why it was dropped
    gone_at: float = 0.0


@dataclass
class PoolReport:
    """What the run summary says about the stream."""

    served: dict[str, int] = field(default_factory=dict)  # samples per server URL
    requeued: int = 0  # samples asked again elsewhere after their server was dropped
    dropped: dict[str, str] = field(default_factory=dict)  # URL -> why, for servers dropped (and not back)
    unservable: dict[str, str] = field(default_factory=dict)  # conversation id -> why


class StatesPool:
    """Bounded, ordered prefetch of samples over several servers (see the module docstring)."""

    def __init__(
        self,
        urls: list[str],
        fetch: Callable[[str, list[int]], Features],
        check: Callable[[str], None],
        requests_per_server: int,
        prefetch: int,
        wait_s: float,
        log: Callable[[str], None] = print,
    ) -> None:
        self.servers = [_Server(u) for u in urls]
        self.fetch = fetch  # (url, token ids) -> features; raises ServerGone / TransportGone / Unservable / ...
        self.check = check  # url -> None, the start-up check a dropped server must pass again to rejoin
        self.per_server = requests_per_server
        self.prefetch = prefetch
        self.wait_s = wait_s
        self.log = log
        self.lock = threading.Condition()
        self.pending: deque[Sample] = deque()  # announced, not yet requested
        self.known: set[str] = set()  # keys pending, in flight or ready
        self.inflight: dict[str, Sample] = {}
        self.ready: dict[str, Features | None] = {}  # None: unservable
        self.fatal: BaseException | None = None
        self.drops: dict[str, int] = {}  # sample key -> connections its requests broke
        self.report = PoolReport()
        self.executor = ThreadPoolExecutor(max_workers=len(urls) * requests_per_server, thread_name_prefix="stream")

    # -- the trainer's side ------------------------------------------------------------------------------
    def want(self, samples: Iterable[Sample]) -> None:
        """Announce samples the trainer will take, in order; already announced ones are left where they are."""
        with self.lock:
            for s in samples:
                if s.key not in self.known:
                    self.known.add(s.key)
                    self.pending.append(s)
            self._dispatch()

    def take(self, sample: Sample) -> Features | None:
        """The sample's features ({"final_hidden": [N, H], "aux_hidden": [N, 3, H]}), None if unservable;
        waits for them (asking first if nobody has). Raises StreamStopped when no server is left, or the
        fatal error a server's answer raised."""
        with self.lock:
            if sample.key not in self.known:
                self.known.add(sample.key)
                self.pending.appendleft(sample)
            elif sample.key not in self.ready and sample.key not in self.inflight:
                self.pending.remove(next(s for s in self.pending if s.key == sample.key))
                self.pending.appendleft(sample)  # the trainer waits for it: first in line, whatever the budget
            give_up: float | None = None
            backoff = 1.0
            while sample.key not in self.ready:
                if self.fatal is not None:
                    raise self.fatal
                self._dispatch(urgent=sample.key)
                if any(s.gone is None for s in self.servers):
                    give_up = None
                    self.lock.wait(timeout=1.0)
                    continue
                now = time.monotonic()
                if give_up is None:
                    give_up, backoff = now + self.wait_s, 1.0
                    self.log(
                        f"train.stream: every server is gone ({self._gone_list()}); asking again for up to "
                        f"{self.wait_s:g} s (train.stream.wait_s)"
                    )
                if now >= give_up:
                    raise StreamStopped(
                        f"every server of train.stream.urls stopped answering and none came back within "
                        f"train.stream.wait_s={self.wait_s:g}: {self._gone_list()}"
                    )
                self.lock.wait(timeout=min(backoff, max(give_up - now, 0.0)))
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                self._revive()
            features = self.ready.pop(sample.key)
            self.known.discard(sample.key)
            self._dispatch()
            return features

    def close(self) -> None:
        """Stop asking; requests in flight finish in the background and their answers are dropped."""
        with self.lock:
            self.pending.clear()
            self.fatal = self.fatal or StreamStopped("the stream was closed")
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- scheduling (under self.lock) ----------------------------------------------------------------------
    def _dispatch(self, urgent: str | None = None) -> None:
        """Send pending samples to the least busy live servers while the prefetch budget allows (the sample
        the trainer waits for goes regardless)."""
        while self.pending:
            head = self.pending[0]
            if head.key != urgent and len(self.inflight) + len(self.ready) >= self.prefetch:
                return
            live = [s for s in self.servers if s.gone is None and s.busy < self.per_server]
            if not live:
                return
            server = min(live, key=lambda s: s.busy)
            self.pending.popleft()
            server.busy += 1
            self.inflight[head.key] = head
            self.executor.submit(self._run, server, head)

    def _run(self, server: _Server, sample: Sample) -> None:
        """A worker thread: one request, its outcome recorded."""
        features: Features | None = None
        gone: str | None = None
        unservable: str | None = None
        fatal: BaseException | None = None
        try:
            features = self.fetch(server.url, sample.token_ids)
        except (ServerGone, TransportGone) as e:
            gone = str(e)
        except Unservable as e:
            unservable = str(e)
        except BaseException as e:  # AnswerMismatch, a bug: the trainer's thread raises it
            fatal = e
        with self.lock:
            server.busy -= 1
            self.inflight.pop(sample.key, None)
            if gone is not None:
                self._drop(server, gone, sample)
            elif fatal is not None:
                self.fatal = self.fatal or fatal
            else:
                self.ready[sample.key] = features
                if unservable is not None:
                    self.report.unservable[sample.label] = unservable
                    self.log(f"train.stream: conversation {sample.label} cannot be served ({unservable}); masked out")
                else:
                    server.served += 1
                    self.report.served[server.url] = server.served
            self._dispatch()
            self.lock.notify_all()

    def _drop(self, server: _Server, reason: str, sample: Sample) -> None:
        drops = self.drops[sample.key] = self.drops.get(sample.key, 0) + 1
        if drops >= MAX_SAMPLE_DROPS:  # it takes servers down (or past the timeout) wherever it goes: give up on it
            why = f"{drops} server(s) stopped answering while serving it, the last: {reason}"
            self.ready[sample.key] = None
            self.report.unservable[sample.label] = why
            self.log(f"train.stream: conversation {sample.label} cannot be served ({why}); masked out")
        else:
            self.pending.appendleft(sample)
            self.report.requeued += 1
        if server.gone is None:
            server.gone, server.gone_at = reason, time.monotonic()
            self.report.dropped[server.url] = reason
            left = [s.url for s in self.servers if s.gone is None]
            self.log(
                f"train.stream: {server.url} stopped answering ({reason}); its samples in flight go to "
                + (", ".join(left) if left else "no server (every one is gone)")
            )

    def _revive(self) -> None:
        """Ask each dropped server again (its start-up check, outside the lock); one that passes rejoins."""
        for server in [s for s in self.servers if s.gone is not None]:
            self.lock.release()
            try:
                self.check(server.url)
                ok = True
            except Exception:  # still gone, or back as something else: not this run's server
                ok = False
            finally:
                self.lock.acquire()
            if ok and server.gone is not None:
                self.log(f"train.stream: {server.url} answers again; it rejoins")
                server.gone = None
                self.report.dropped.pop(server.url, None)

    def _gone_list(self) -> str:
        return "; ".join(f"{s.url} ({s.gone})" for s in self.servers)
