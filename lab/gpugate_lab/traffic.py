"""A bounded client for the lab: requests through a URL (smg's, or one server's) as real clients send
them, for the tests and for an operator (``gpugate lab traffic --url URL --rate R --seconds S``).

It drives two kinds of load at once, both with the real ``openai`` package (the test extra):

- **paced**: ``rate`` requests a second, bounded by ``seconds`` (or until :meth:`Traffic.stop`), a share
  ``stream_share`` of them streamed chat completions (``stream_tokens`` tokens, a chunk each), the rest
  whole chat completions; each request in a thread of its own, so a slow server does not slow the pace;
- **closed loops** (optional, what the router lab's rolling change uses): ``generate_threads`` threads
  of SGLang's native ``POST /generate``, ``chat_threads`` of whole chat completions and
  ``stream_threads`` of streams, each sending its next request when its last one ended (and
  ``pause_s`` later: a client's think time, which keeps a loop from taking a whole core of the lab).

Every failure is counted with its reason: an HTTP or connection error, an error event in a stream, a
stream cut short or EMPTY (not every token, no finish reason, or no ``[DONE]``), an answer that is not the
lab's text. A stream is served only when whole. The client measures the time to first token it sees
(the first chunk with content) and the time of each whole stream.

Example::

    with Traffic(router_url, rate=5, seconds=60, stream_share=0.5) as traffic:
        ...                                    # a rolling change under traffic
    result = traffic.result()
    assert result.failed == 0, result.errors[:5]
    print(result.summary())   # "sent 300, ok 300, failed 0; TTFT p50 0.012 s, p95 0.031 s (150 streams)"
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, List, Optional

LAB_PIECE = " lab"  # what the lab's stand-ins answer per token


def quantile(values: List[float], q: float) -> Optional[float]:
    """The q-quantile by linear interpolation between the nearest ranks (numpy's default); None if empty.

    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5), quantile([5.0], 0.95), quantile([], 0.5)
    (2.5, 5.0, None)
    """
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Result:
    """What a run saw: ``sent`` requests begun, ``ok`` answered whole, ``failed`` (with ``errors``, one
    reason each), ``streams_ok`` whole streams and ``stream_s`` each one's duration, ``ttft_s`` the time
    to first token of each stream the client saw, ``in_flight`` requests still unanswered."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: List[str] = field(default_factory=list)
    streams_ok: int = 0
    stream_s: List[float] = field(default_factory=list)
    ttft_s: List[float] = field(default_factory=list)
    in_flight: int = 0

    def ttft(self, q: float) -> Optional[float]:
        return quantile(self.ttft_s, q)

    def summary(self) -> str:
        """One line: counts and the client's TTFT quantiles.

        >>> Result(sent=3, ok=2, failed=1, errors=["500"], ttft_s=[0.1, 0.2]).summary()
        'sent 3, ok 2, failed 1; TTFT p50 0.150 s, p95 0.195 s (2 streams); first failure: 500'
        """
        line = f"sent {self.sent}, ok {self.ok}, failed {self.failed}"
        if self.in_flight:
            line += f", {self.in_flight} unanswered"
        if self.ttft_s:
            line += f"; TTFT p50 {self.ttft(0.5):.3f} s, p95 {self.ttft(0.95):.3f} s ({len(self.ttft_s)} streams)"
        else:
            line += "; no stream answered: no TTFT"
        if self.errors:
            line += f"; first failure: {self.errors[0]}"
        return line


class Traffic:
    """Background requests through ``url`` (no ``/v1``): see the module. ``model``: the served model
    name the chat completions name (default: the first of ``/v1/models``). ``max_requests`` bounds the
    count, ``seconds`` the time (None: until :meth:`stop`). ``timeout_s``: one request's limit."""

    def __init__(self, url: str, rate: float = 0.0, seconds: Optional[float] = 60.0, stream_share: float = 0.5,
                 stream_tokens: int = 20, answer_tokens: int = 20, model: Optional[str] = None,
                 generate_threads: int = 0, chat_threads: int = 0, stream_threads: int = 0,
                 max_requests: int = 100000, timeout_s: float = 30.0, pause_s: float = 0.0) -> None:
        import openai

        if rate < 0 or not 0.0 <= stream_share <= 1.0:
            raise ValueError(f"rate must be >= 0 and stream_share within 0..1 (got rate {rate}, "
                             f"stream_share {stream_share})")
        self.url, self.rate, self.seconds, self.stream_share = url.rstrip("/"), rate, seconds, stream_share
        self.stream_tokens, self.answer_tokens, self.max_requests = stream_tokens, answer_tokens, max_requests
        self.model = model
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="lab", max_retries=0, timeout=timeout_s)
        self.timeout_s = timeout_s
        self.pause_s = pause_s  # a closed loop's think time between one answer and its next request
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._result = Result()
        self.threads: List[threading.Thread] = []
        loops = [self._generate] * generate_threads + [self._chat] * chat_threads + [self._stream] * stream_threads
        self._loops = loops
        self.began = 0.0

    # ------------------------------------------------------------ one request each
    def _model(self) -> str:
        if self.model is None:
            self.model = self.openai.models.list().data[0].id
        return self.model

    def _generate(self, prompt: str) -> Optional[str]:
        body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": self.answer_tokens}}).encode()
        request = urllib.request.Request(self.url + "/generate", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()
            return None if response.status == 200 else f"generate: status {response.status}"

    def _chat(self, prompt: str) -> Optional[str]:
        answer = self.openai.chat.completions.create(model=self._model(), messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=self.answer_tokens)
        content = answer.choices[0].message.content if answer.choices else None
        return None if content == LAB_PIECE * self.answer_tokens else f"chat: answer {content!r}"[:200]

    def _stream(self, prompt: str) -> Optional[str]:
        began, text, finish, first = time.monotonic(), [], None, None
        stream = self.openai.chat.completions.create(model=self._model(), messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=self.stream_tokens, stream=True)
        chunks = 0
        for chunk in stream:  # the openai package raises on an error event and on a cut body
            chunks += 1
            if chunk.choices:
                piece = chunk.choices[0].delta.content or ""
                if piece and first is None:
                    first = time.monotonic() - began
                text.append(piece)
                finish = chunk.choices[0].finish_reason or finish
        if not chunks:
            return "stream: empty (no chunk before its end)"
        if "".join(text) != LAB_PIECE * self.stream_tokens or finish is None:
            return (f"stream: cut, {len(''.join(text)) // len(LAB_PIECE)} of {self.stream_tokens} tokens, "
                    f"finish {finish!r}")
        with self.lock:
            self._result.streams_ok += 1
            self._result.stream_s.append(time.monotonic() - began)
            if first is not None:
                self._result.ttft_s.append(first)
        return None

    def _one(self, send: Callable[[str], Optional[str]]) -> None:
        import openai

        with self.lock:
            self._result.sent += 1
            self._result.in_flight += 1
            n = self._result.sent
        prompt = f"{os.urandom(4).hex()} hello {n}"  # no shared prefix: a router spreads them
        try:
            error = send(prompt)
        except (urllib.error.URLError, OSError, openai.APIError, ValueError) as exc:
            error = f"{send.__name__.lstrip('_')}: {exc!r} ({exc.__cause__!r})"[:300]
        with self.lock:
            self._result.in_flight -= 1
            if error is None:
                self._result.ok += 1
            else:
                self._result.failed += 1
                self._result.errors.append(error)

    # ------------------------------------------------------------ the drivers
    def _due(self) -> bool:
        """Go on: not stopped, within the time, under the count."""
        if self.stopping.is_set():
            return False
        if self.seconds is not None and time.monotonic() - self.began >= self.seconds:
            return False
        with self.lock:
            return self._result.sent < self.max_requests

    def _loop(self, send: Callable[[str], Optional[str]]) -> None:
        while self._due():
            self._one(send)
            if self.pause_s:
                self.stopping.wait(self.pause_s)

    def _paced(self) -> None:
        interval, k, streams = 1.0 / self.rate, 0, 0.0
        workers: List[threading.Thread] = []
        while True:
            due = self.began + k * interval
            self.stopping.wait(max(0.0, due - time.monotonic()))
            if not self._due():
                break
            # the share of streams, spread evenly: a stream whenever the share owed reaches a whole one
            streams += self.stream_share
            send = self._chat
            if streams >= 1.0 - 1e-9:
                streams -= 1.0
                send = self._stream
            worker = threading.Thread(target=self._one, args=(send,), daemon=True)
            worker.start()
            workers.append(worker)
            workers = [w for w in workers if w.is_alive()]
            k += 1
        for worker in workers:
            worker.join(timeout=self.timeout_s + 5)

    def start(self) -> "Traffic":
        self.began = time.monotonic()
        self.threads = [threading.Thread(target=self._loop, args=(send,), daemon=True) for send in self._loops]
        if self.rate > 0:
            self.threads.append(threading.Thread(target=self._paced, daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> Result:
        """Stop sending, wait for the requests in flight (each within its timeout), the result."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=self.timeout_s + 10)
        return self.result()

    def wait(self) -> Result:
        """Until the bounded time is over and the last answer is in (``seconds`` must be set)."""
        if self.seconds is None:
            raise ValueError("wait() needs a bounded run (seconds=...); call stop() instead")
        for thread in self.threads:
            thread.join(timeout=self.seconds + self.timeout_s + 10)
        return self.result()

    def result(self) -> Result:
        """A copy of the figures so far."""
        with self.lock:
            r = self._result
            return Result(r.sent, r.ok, r.failed, list(r.errors), r.streams_ok, list(r.stream_s), list(r.ttft_s),
                          r.in_flight)

    # the figures so far, as attributes (a test's assertions read them after the run)
    ok = property(lambda self: self.result().ok)
    failed = property(lambda self: self.result().failed)
    errors = property(lambda self: self.result().errors)
    streams_ok = property(lambda self: self.result().streams_ok)
    stream_s = property(lambda self: self.result().stream_s)

    def __enter__(self) -> "Traffic":
        self.start()
        time.sleep(0.5)  # the first requests under way before the caller acts
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(url: str, rate: float, seconds: float, stream_share: float = 0.5, model: Optional[str] = None) -> int:
    """``gpugate lab traffic``: run, print the one-line summary; 0 when nothing failed."""
    traffic = Traffic(url, rate=rate, seconds=seconds, stream_share=stream_share, model=model).start()
    try:
        result = traffic.wait()
    except KeyboardInterrupt:
        result = traffic.stop()
    print(result.summary())
    return 0 if result.failed == 0 and result.sent else 1
