"""Any OpenAI-compatible server (vLLM, SGLang, llama.cpp) as a speceyes backend.

Each conversation of a batch is one ``/v1/chat/completions`` request; a batch is sent
concurrently (``asyncio.gather`` on an ``AsyncOpenAI`` client) so the server batches them. The
protocol methods stay synchronous: the requests run on an event loop that this backend owns in a
background thread, so the sync facade also works when the caller already runs an event loop.

Geometry lives on the client: every image is smart_resized here with the model family's factor
and pixel limits and sent as a PNG data URI. Servers ignore per-request pixel limits, and mapping
a zoom box back to the original image needs the exact scale the model saw.

Several base URLs are replicas of one model: each request goes to the replica with the fewest
requests in flight, a replica that fails (connection error, timeout, 5xx, 429) is set aside for a
short, growing cool-down and the request is retried elsewhere, with exponential backoff once no
healthy replica is left; after ``max_retries`` retries a ``BackendError`` names the URLs.

Known server differences (documented, handled here):

* top_logprobs is capped by the server (vLLM: ``--max-logprobs``, default 20); ``top_k`` above
  ``max_logprobs`` is refused with a ValueError before any request.
* llama.cpp (llama-cpp-python) keys top logprobs by token *text*: tokens that decode alike
  (e.g. partial UTF-8 bytes) merge, so a row can hold fewer than K values. We ask for a few more
  than K where the cap allows and pad short rows with -inf (such a token's separability is NaN
  and the answer is never accepted). Its sampler also applies ``repeat_penalty`` (default 1.1)
  even at temperature 0: pass ``extra_body={"repeat_penalty": 1.0}`` for plain greedy decoding.
* Servers strip the stop string from the returned text. vLLM says which one matched
  (``stop_reason``), SGLang too (``matched_stop``); otherwise it is inferred from the text: the
  closing tag among the stop strings whose opening tag is still unclosed (``<tool_call>`` ->
  ``</tool_call>``, ``<answer>`` -> ``</answer>``, ``<code>`` -> ``</code>``). The stop string is
  re-appended, as the HF backend keeps it. EOS-like stops (``<|im_end|>``) are never appended.
* The API returns token strings, not ids: ``SpecAnswer.token_ids`` stays empty; the number of
  answer tokens is ``len(topk)``.
* ``next_token_probs`` generates one token (``max_tokens=1``) with the server's whole cap of top
  logprobs (``max_logprobs``), or fewer when asked (``top_logprobs``). A word counts by the top token whose text is exactly the word, so
  the words should be single tokens (yes, no, digits); a word outside the top logprobs gets 0:
  the mass beyond the cap is unknown, not spread over the words.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
from PIL import Image

from speceyes.backends.base import (
    BackendError,
    Messages,
    Scores,
    decoding_settings,
    map_images,
    view_geometry,
)
from speceyes.images import View, load_image, resize_for_model, to_data_uri, view_for_model
from speceyes.types import ChatTurn, SpecAnswer

log = logging.getLogger(__name__)

T = TypeVar("T")
Family = Literal["qwen2_5_vl", "qwen3_vl"]
# Extra top logprobs requested (cap permitting) to make up for rows merged by token text.
_LOGPROB_SLACK = 8
_MAX_COOLDOWN = 30.0
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class _Replica:
    url: str
    client: Any  # openai.AsyncOpenAI
    inflight: int = 0
    served: int = 0
    failures: int = 0  # consecutive
    total_failures: int = 0
    down_until: float = 0.0


class OpenAIBackend:
    """A model behind one or more OpenAI-compatible ``/v1`` endpoints."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str | None = None,
        *,
        api_key: str = "EMPTY",
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_logprobs: int = 20,
        family: Family = "qwen2_5_vl",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        name: str | None = None,
        extra_body: dict[str, Any] | None = None,
        max_concurrency: int = 64,
        eos_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>"),
        max_images: int | None = None,
        decoding: str = "checkpoint",
    ) -> None:
        try:
            import openai
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                "OpenAIBackend needs the openai package: pip install 'speceyes[serve]'"
            ) from e
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("base_urls is empty: give at least one http://host:port/v1 URL")
        geometry = view_geometry(family, min_pixels=min_pixels, max_pixels=max_pixels)
        if max_retries < 0 or max_logprobs < 1 or max_concurrency < 1:
            raise ValueError("max_retries must be >= 0, max_logprobs and max_concurrency >= 1")
        self._openai = openai
        self.family = family
        # The family's defaults (DeepEyes' 4..16384 merged patches) unless limits are given.
        self.box_coords, self.factor, self.min_pixels, self.max_pixels = geometry
        self.scores: Scores = "logprobs"  # servers return top logprobs, never whole rows
        self.model = model
        self.name = name or model or urls[0]
        self._named = name is not None or model is not None
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_logprobs = int(max_logprobs)
        # The server's per-prompt image limit (vLLM --limit-mm-per-prompt), if it has one.
        self.max_images = max_images
        # "checkpoint": the server applies its model's generation_config (vLLM's default);
        # "greedy-plain" sends the neutral settings with every request.
        plain = {} if decoding == "checkpoint" else decoding_settings(decoding, None)
        self.decoding: dict[str, Any] = {"policy": decoding, **plain}
        self.extra_body = {**plain, **dict(extra_body or {})}
        self.eos_tokens = tuple(eos_tokens)
        self._max_concurrency = max_concurrency
        self._api_key = api_key
        self._urls = urls
        self._replicas: list[_Replica] = []
        self._tie = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sem: asyncio.Semaphore | None = None
        self._model_lock: asyncio.Lock | None = None
        self._start_lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        # Agent loops resend the same PIL images every turn: cache their encoded form.
        self._uri_cache: OrderedDict[int, tuple[weakref.ref, str]] = OrderedDict()
        self._cache_lock = threading.Lock()

    # ---- event loop and replicas ----------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    ready.set()
                    loop.run_forever()

                thread = threading.Thread(
                    target=run, name=f"speceyes-openai-{id(self)}", daemon=True
                )
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
                # A backend dropped without close() must not leave its loop thread running.
                self._finalizer = weakref.finalize(self, _stop_loop, loop)
                # Clients are created on the loop that will use them (httpx pools are per loop).
                self._submit(self._init_clients()).result()
            return self._loop

    async def _init_clients(self) -> None:
        self._sem = asyncio.Semaphore(self._max_concurrency)
        self._model_lock = asyncio.Lock()
        self._replicas = [_Replica(url=u, client=self._client(u)) for u in self._urls]

    def _client(self, url: str) -> Any:
        kwargs: dict[str, Any] = {}
        if urllib.parse.urlsplit(url).hostname in _LOOPBACK:
            # A server on this machine is never reached through an HTTP(S)_PROXY from the env.
            kwargs["http_client"] = self._openai.DefaultAsyncHttpxClient(trust_env=False)
        # Retries are ours (with failover across replicas), not the client's.
        return self._openai.AsyncOpenAI(
            base_url=url, api_key=self._api_key, timeout=self.timeout, max_retries=0, **kwargs
        )

    def _submit(self, coro: Awaitable[T]) -> Future[T]:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def _run(self, coro_fn: Callable[[], Awaitable[T]]) -> T:
        self._ensure_loop()
        if threading.current_thread() is self._thread:
            raise RuntimeError("OpenAIBackend's sync methods cannot be called from its own loop")
        return self._submit(coro_fn()).result()

    def close(self) -> None:
        """Close the HTTP clients and stop the background loop; a later call starts anew."""
        with self._start_lock:
            loop, thread = self._loop, self._thread
            if loop is None:
                return

            async def shutdown() -> None:
                for r in self._replicas:
                    await r.client.close()

            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
            finally:
                if self._finalizer is not None:
                    self._finalizer.detach()
                loop.call_soon_threadsafe(loop.stop)
                if thread is not None:
                    thread.join(timeout=10)
                loop.close()
                self._loop = self._thread = None

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per base URL: requests in flight, served, and failures (consecutive and total)."""
        return [
            {
                "url": r.url,
                "inflight": r.inflight,
                "served": r.served,
                "failures": r.failures,
                "total_failures": r.total_failures,
                "healthy": r.down_until <= time.monotonic(),
            }
            for r in self._replicas
        ]

    def _pick(self) -> _Replica:
        """The healthy replica with the fewest requests in flight (ties rotate)."""
        now = time.monotonic()
        healthy = [r for r in self._replicas if r.down_until <= now]
        if not healthy:
            return min(self._replicas, key=lambda r: r.down_until)
        least = min(r.inflight for r in healthy)
        tied = [r for r in healthy if r.inflight == least]
        self._tie += 1
        return tied[self._tie % len(tied)]

    def _retryable(self, e: Exception) -> bool:
        o = self._openai
        if isinstance(e, (o.APITimeoutError, o.APIConnectionError)):
            return True
        if isinstance(e, o.APIStatusError):
            return e.status_code >= 500 or e.status_code == 429
        return False

    async def _call(self, fn: Callable[[Any], Awaitable[T]], what: str) -> T:
        """Run ``fn(client)`` on the least-loaded replica, failing over and backing off."""
        errors: list[tuple[str, str]] = []  # (url, error)
        for attempt in range(self.max_retries + 1):
            rep = self._pick()
            now = time.monotonic()
            if attempt and rep.down_until > now:
                # Every replica failed recently: wait before trying again.
                await asyncio.sleep(min(self.backoff * 2 ** (attempt - 1), _MAX_COOLDOWN))
            rep.inflight += 1
            try:
                out = await fn(rep.client)
            except Exception as e:
                if not isinstance(e, self._openai.OpenAIError):
                    raise
                err = f"{type(e).__name__}: {_short(e)}"
                if not self._retryable(e):
                    raise BackendError(f"{self.name}: {what} refused by {rep.url}: {err}") from e
                errors.append((rep.url, err))
                rep.failures += 1
                rep.total_failures += 1
                cool = min(self.backoff * 2 ** (rep.failures - 1), _MAX_COOLDOWN)
                rep.down_until = time.monotonic() + cool
                log.warning(
                    "%s: %s failed (attempt %d) on %s: %s",
                    self.name,
                    what,
                    attempt + 1,
                    rep.url,
                    err,
                )
                continue
            finally:
                rep.inflight -= 1
            rep.failures, rep.down_until = 0, 0.0
            rep.served += 1
            return out
        urls = ", ".join(dict.fromkeys(u for u, _ in errors))
        last = errors[-1][1].rstrip(".")
        raise BackendError(
            f"{self.name}: {what} failed after {self.max_retries + 1} attempts against {urls}; "
            f"last error: {last}. Is the server running and reachable at that URL?"
        )

    async def _model(self) -> str:
        assert self._model_lock is not None
        async with self._model_lock:  # a batch's requests ask once, not once each
            return await self._resolve_model()

    async def _resolve_model(self) -> str:
        if self.model is None:

            async def first(client: Any) -> str:
                page = await client.models.list()
                ids = [m.id for m in page.data]
                if not ids:
                    raise BackendError(f"{self.name}: the server lists no models at /v1/models")
                return ids[0]

            self.model = await self._call(first, "GET /v1/models")
            if not self._named:
                self.name = self.model
        return self.model

    async def _complete(self, messages: list[dict[str, Any]], what: str, **params: Any) -> Any:
        model = await self._model()
        assert self._sem is not None
        body = {**self.extra_body, **params.pop("extra_body", {})}

        async def create(client: Any) -> Any:
            return await client.chat.completions.create(
                model=model, messages=messages, temperature=0.0, extra_body=body or None, **params
            )

        async with self._sem:
            resp = await self._call(create, what)
        if not resp.choices:
            raise BackendError(f"{self.name}: {what}: the server returned no choices")
        return resp

    def _send(self, batch: Sequence[Messages], what: str, **params: Any) -> list[Any]:
        """One request per conversation, all in flight together; responses in batch order."""
        # Images are resized and PNG-encoded in the caller's thread, not on the shared loop,
        # so a large image never stalls requests that are already in flight.
        converted = [self._convert(m) for m in batch]
        # A conversation whose last assistant message is marked "continue" (Thyme writes its
        # sandbox output into the same turn) is continued, not answered with a new turn: vLLM
        # and SGLang take these two chat-template switches in the request body.
        cont = {"continue_final_message": True, "add_generation_prompt": False}
        extras = [
            {**params.get("extra_body", {}), **cont} if m and m[-1].get("continue") else None
            for m in batch
        ]

        async def gather() -> list[Any]:
            calls = []
            for c, extra in zip(converted, extras, strict=True):
                kw = dict(params) if extra is None else {**params, "extra_body": extra}
                calls.append(self._complete(c, what, **kw))
            return list(await asyncio.gather(*calls))

        return self._run(gather)

    # ---- geometry and messages ------------------------------------------------------------
    def view_of(self, image: Any) -> View:
        img = load_image(image)
        return view_for_model(img, self.factor, self.min_pixels, self.max_pixels)

    def _data_uri(self, src: Any) -> str:
        """The image as the model must see it (smart_resized here) as a PNG data URI."""
        cacheable = isinstance(src, Image.Image)  # paths and bytes are encoded every time
        if cacheable:
            with self._cache_lock:
                hit = self._uri_cache.get(id(src))
                # The weakref guards against a new image that reuses a freed image's id.
                if hit is not None and hit[0]() is src:
                    self._uri_cache.move_to_end(id(src))
                    return hit[1]
        img, _ = resize_for_model(load_image(src), self.factor, self.min_pixels, self.max_pixels)
        uri = to_data_uri(img, "PNG")
        if cacheable:
            with self._cache_lock:
                self._uri_cache[id(src)] = (weakref.ref(src), uri)
                while len(self._uri_cache) > 256:
                    self._uri_cache.popitem(last=False)
        return uri

    def _convert(self, messages: Messages) -> list[dict[str, Any]]:
        """speceyes image parts -> OpenAI ``image_url`` parts; text and strings unchanged."""
        return map_images(
            messages, lambda src: {"type": "image_url", "image_url": {"url": self._data_uri(src)}}
        )

    # ---- logprobs -------------------------------------------------------------------------
    def _check_top_k(self, top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if top_k > self.max_logprobs:
            raise ValueError(
                f"top_k={top_k} exceeds the server's logprob cap (max_logprobs="
                f"{self.max_logprobs}). Start vLLM with --max-logprobs {top_k} and pass "
                f"max_logprobs={top_k} to OpenAIBackend, or use top_k <= {self.max_logprobs} "
                f"(and calibrate tau for that K)."
            )

    def _content(self, choice: Any) -> list[Any]:
        lp = getattr(choice, "logprobs", None)
        return list(getattr(lp, "content", None) or [])

    def _require_logprobs(self, content: list[Any], choice: Any) -> None:
        # Text but no logprobs: the server ignores the parameter (an empty reply is just EOS).
        if not content and (choice.message.content or "").strip():
            raise BackendError(
                f"{self.name}: the server returned text but no logprobs; it must support "
                "logprobs/top_logprobs (llama-cpp-python: start it with --logits_all true)"
            )

    def _strip_eos(self, content: list[Any], finish: str | None) -> list[Any]:
        # vLLM reports the EOS token itself; llama.cpp does not. Never score EOS.
        while content and finish == "stop" and content[-1].token in self.eos_tokens:
            content = content[:-1]
        return content

    @staticmethod
    def _row(entry: Any, k: int) -> np.ndarray:
        vals = sorted((_finite(t.logprob) for t in (entry.top_logprobs or [])), reverse=True)[:k]
        row = np.full(k, -np.inf)
        row[: len(vals)] = vals
        return row

    # ---- protocol -------------------------------------------------------------------------
    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        if not batch:
            return np.zeros((0, len(words)))
        n = self.max_logprobs if top_logprobs is None else min(top_logprobs, self.max_logprobs)
        resps = self._send(batch, "next token", max_tokens=1, logprobs=True, top_logprobs=n)
        out = np.zeros((len(batch), len(words)))
        for i, r in enumerate(resps):
            content = self._content(r.choices[0])
            self._require_logprobs(content, r.choices[0])
            if content:
                out[i] = word_probs(
                    [(t.token or "", _finite(t.logprob)) for t in content[0].top_logprobs or []],
                    words,
                )
        return out

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        self._check_top_k(top_k)
        if not batch:
            return []
        ask = min(self.max_logprobs, top_k + _LOGPROB_SLACK)
        resps = self._send(
            batch, "answer", max_tokens=max_new_tokens, logprobs=True, top_logprobs=ask
        )
        answers = []
        for r in resps:
            choice = r.choices[0]
            self._require_logprobs(self._content(choice), choice)
            content = self._strip_eos(self._content(choice), choice.finish_reason)
            topk = (
                np.stack([self._row(e, top_k) for e in content])
                if content
                else np.zeros((0, top_k))
            )
            answers.append(SpecAnswer(text=(choice.message.content or "").strip(), topk=topk))
        return answers

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        if not batch:
            return []
        params: dict[str, Any] = {"max_tokens": max_new_tokens}
        if stop:
            params["stop"] = list(stop)
        resps = self._send(batch, "chat", **params)
        turns = []
        for r in resps:
            choice = r.choices[0]
            text = choice.message.content or ""
            finish = "length" if choice.finish_reason == "length" else "stop"
            which = None
            if finish == "stop" and stop:
                which = self._which_stop(choice, text, stop)
                if which is not None and not text.endswith(which):
                    text += which  # servers strip it; the HF backend keeps it
            usage = getattr(r, "usage", None)
            tokens = int(getattr(usage, "completion_tokens", 0) or 0)
            turns.append(ChatTurn(text=text, finish_reason=finish, stop=which, tokens=tokens))
        return turns

    def _which_stop(self, choice: Any, text: str, stop: Sequence[str]) -> str | None:
        """The stop string that ended a turn, or None when EOS (or an EOS-like stop) did."""
        extra = getattr(choice, "model_extra", None) or {}
        for key in ("stop_reason", "matched_stop"):  # vLLM, SGLang
            if key in extra:
                reason = extra[key]
                return reason if isinstance(reason, str) and reason in stop else None
        candidates = [s for s in stop if s not in self.eos_tokens]
        for s in candidates:
            if text.endswith(s):
                return s  # a server that keeps the stop string
        # Infer: a closing tag whose opening tag is still open at the end of the text.
        best: tuple[int, str] | None = None
        for s in candidates:
            if s.startswith("</") and s.endswith(">"):
                opening = "<" + s[2:]
                at = text.rfind(opening)
                if at >= 0 and text.rfind(s) < at and (best is None or at > best[0]):
                    best = (at, s)
        return best[1] if best else None

    # ---- async variants, for callers that run an event loop --------------------------------
    async def aanswer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        return await asyncio.to_thread(self.answer, batch, max_new_tokens, top_k)

    async def achat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        return await asyncio.to_thread(self.chat, batch, stop, max_new_tokens)


def word_probs(top: Sequence[tuple[str, float]], words: Sequence[str]) -> np.ndarray:
    """P(word) per word from one token's top ``(token text, logprob)`` pairs.

    A word takes the probability of the top token whose text equals it (the most probable one
    if several do: servers that key by text merge them); a word not among them, a blank word
    and a repeat of an earlier word get 0 (each token counts once).
    """
    best: dict[str, float] = {}
    for text, lp in top:
        if lp > best.get(text, -math.inf):
            best[text] = lp
    out, seen = np.zeros(len(words)), set()
    for j, w in enumerate(words):
        if w in best and w.strip() and w not in seen:
            out[j] = math.exp(best[w])
        seen.add(w)
    return out


def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


def _finite(x: float | None) -> float:
    """A logprob as a float; None (some servers for -inf) becomes -inf."""
    return -math.inf if x is None else float(x)


def _short(e: BaseException, limit: int = 300) -> str:
    s = str(e).replace("\n", " ").strip()
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in s:
        # "Connection error." alone hides "connection refused" vs a DNS or TLS failure.
        s = f"{s.rstrip('.')} ({type(cause).__name__}: {str(cause).strip()})"
    return s if len(s) <= limit else s[: limit - 3] + "..."
