"""Any OpenAI-compatible server (vLLM, SGLang, llama.cpp) as a speceyes backend.

Each conversation of a batch is one ``/v1/chat/completions`` request; a batch is sent
concurrently (``asyncio.gather`` on an ``AsyncOpenAI`` client) so the server batches them. The
protocol methods stay synchronous: the requests run on an event loop that this backend owns in a
background thread, so the sync facade also works when the caller already runs an event loop.

Geometry lives on the client: every image is smart_resized here with the model family's factor
and pixel limits and sent as a PNG data URI. Servers ignore per-request pixel limits, and mapping
a zoom box back to the original image needs the exact scale the model saw.

Several base URLs are replicas of one model. By default (``routing="affinity"``) every call of
one query goes to one replica: the key of a conversation is a digest of its first image as sent
(the judge prompt and each agent turn of a query carry the same image, so they agree with no
query id plumbed through), placed by bounded-load consistent hashing (``routing.Router``), so
that replica's prefix cache and encoder cache serve the later calls. ``routing="least-loaded"``
sends each request to the replica with the fewest requests in flight. With ``session_header``
the key also goes out as that HTTP header (e.g. ``X-Session-Id``) for a gateway that routes by
session. A replica that fails (connection error, timeout, 5xx, 429) is set aside for a short,
growing cool-down and the request is retried elsewhere, with exponential backoff once no
healthy replica is left; after ``max_retries`` retries a ``BackendError`` names the URLs.
``recent_requests()`` lists the last model calls: the replica that answered each, its affinity
key and the token usage the server reported (cached prompt tokens where the server reports them:
vLLM with ``--enable-prompt-tokens-details``), so a run can see where its calls went and what
the prefix caches saved.

Which model: ``model`` names it (a gateway behind one URL may serve several: Ray Serve LLM,
SGLang's router, llm-d, Dynamo); unnamed, the one model ``/v1/models`` lists. A server that lists
several models when none is named, or does not list the named one, is refused with what it lists.
``check_servers`` runs the start-up checks against every replica: the model, the context length
it reports (vLLM and SGLang list ``max_model_len``), and one tiny probe request that counts the
finite top logprobs the server really returns.

Known server differences (documented, handled here):

* top_logprobs is capped by the server (vLLM: ``--max-logprobs``, default 20); ``top_k`` above
  ``max_logprobs`` is refused with a ValueError before any request. vLLM sends -9999.0 for a
  logprob of -inf (JSON has no infinity): values at or below it are read as -inf.
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
import json
import logging
import math
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict, deque
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
from speceyes.backends.routing import Replica, Router, Routing, digest
from speceyes.images import View, load_image, resize_for_model, to_data_uri, view_for_model
from speceyes.types import ChatTurn, SpecAnswer

log = logging.getLogger(__name__)

T = TypeVar("T")
Family = Literal["qwen2_5_vl", "qwen3_vl"]
# Extra top logprobs requested (cap permitting) to make up for rows merged by token text.
_LOGPROB_SLACK = 8
_MAX_COOLDOWN = 30.0
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# vLLM's stand-in for a logprob of -inf (serving_chat: max(logprob, -9999.0)).
_SERVER_NEG_INF = -9999.0
# The start-up probe: one generated token of a tiny text-only prompt.
_PROBE_MESSAGES = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]
MODEL_FRAGMENT = "model"  # URL#model=ID names the model behind a URL
RECENT_REQUESTS = 1024  # model calls recent_requests() keeps, newest last


@dataclass(frozen=True)
class RequestRecord:
    """One model call as it was answered: the replica (base URL), what it was ("next token",
    "answer", "chat"), the affinity key it was routed by, and the usage the server reported
    (None: not reported)."""

    url: str
    what: str
    key: int | None
    prompt_tokens: int | None
    cached_tokens: int | None  # of prompt_tokens, served from the server's prefix cache
    completion_tokens: int | None


@dataclass(frozen=True)
class ServerSpec:
    """A ``--small`` / ``--large`` value that names servers: replica URLs and the model id."""

    urls: tuple[str, ...]
    model: str | None = None


def parse_server_spec(spec: str, model: str | None = None) -> ServerSpec:
    """``URL[,URL...]`` with an optional ``#model=ID`` (on the whole value or on each URL; they
    must agree), and ``model`` given apart (``--small-model``), which must agree too."""
    urls, named = [], {model} - {None}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        url, _, fragment = part.partition("#")
        if fragment:
            query = urllib.parse.parse_qs(fragment, keep_blank_values=True)
            if set(query) != {MODEL_FRAGMENT} or len(query[MODEL_FRAGMENT]) != 1:
                raise ValueError(f"{part!r}: the only URL fragment speceyes reads is #model=ID")
            named.add(query[MODEL_FRAGMENT][0].strip())
        urls.append(url)
    if "" in named:
        raise ValueError(f"{spec!r}: #model= names no model")
    if len(named) > 1:
        raise ValueError(f"{spec!r}: two model ids given ({', '.join(sorted(named))})")
    return ServerSpec(tuple(urls), next(iter(named), None))


def with_model(spec: str, model: str | None) -> str:
    """``spec`` with ``model`` written in as ``#model=ID`` (unchanged when ``model`` is None);
    refused when ``spec`` is no URL or already names another model."""
    if model is None:
        return spec
    if not spec.startswith(("http://", "https://")):
        raise ValueError(f"a model id ({model!r}) names a model behind a URL, not {spec!r}")
    if parse_server_spec(spec).model is not None:
        parse_server_spec(spec, model)  # refused unless it is the same id
        return spec
    return f"{spec}#{MODEL_FRAGMENT}={model}"


def choose_model(listed: Sequence[str], wanted: str | None, where: str) -> str:
    """The model id to send: ``wanted`` if ``listed`` has it, else the only one listed;
    refused (BackendError) with what is listed otherwise."""
    shown = ", ".join(listed) if listed else "no models"
    if wanted is not None:
        if wanted in listed:
            return wanted
        raise BackendError(f"{where} does not serve model {wanted!r}; /v1/models lists: {shown}")
    if len(listed) == 1:
        return listed[0]
    if not listed:
        raise BackendError(f"{where}: the server lists no models at /v1/models")
    raise BackendError(
        f"{where} serves {len(listed)} models ({shown}); name one with --small-model ID / "
        "--large-model ID or URL#model=ID"
    )


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
        routing: Routing = "affinity",
        session_header: str | None = None,
        max_model_len: int | None = None,
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
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        Router([], routing)  # an unknown routing is refused here, before any request
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
        self.routing: Routing = routing
        # Sent with every call, its value the conversation's affinity key (one per query).
        self.session_header = session_header
        self._given_max_model_len = max_model_len  # wins over what the servers report
        self._listed = False  # /v1/models read (the model id and its max_model_len)
        self._reported_max_model_len: int | None = None  # the least any listing reported
        self._replicas: list[Replica] = []
        self._router: Router | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sem: asyncio.Semaphore | None = None
        self._model_lock: asyncio.Lock | None = None
        self._start_lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        # Agent loops resend the same PIL images every turn: cache their encoded form, and the
        # digest of each data URI (the affinity key of the conversations it opens).
        self._uri_cache: OrderedDict[int, tuple[weakref.ref, str]] = OrderedDict()
        self._key_cache: OrderedDict[str, int] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self._recent_lock = threading.Lock()

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
        self._replicas = [Replica(url=u, client=self._client(u)) for u in self._urls]
        self._router = Router(self._replicas, self.routing)

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
        """Per base URL: requests in flight, model calls served, failures (consecutive and
        total), and what its start-up check measured."""
        return [
            {
                "url": r.url,
                "inflight": r.inflight,
                "served": r.served,
                "failures": r.failures,
                "total_failures": r.total_failures,
                "healthy": r.healthy(time.monotonic()),
                "max_model_len": r.max_model_len,
                "finite_logprobs": r.finite_logprobs,
            }
            for r in self._replicas
        ]

    def recent_requests(self) -> list[RequestRecord]:
        """The last ``RECENT_REQUESTS`` model calls, oldest first (start-up checks and model
        listings are not model calls)."""
        with self._recent_lock:
            return list(self._recent)

    def _record(self, url: str, what: str, key: int | None, resp: Any) -> None:
        usage = getattr(resp, "usage", None)
        details = getattr(usage, "prompt_tokens_details", None)
        record = RequestRecord(
            url=url,
            what=what,
            key=key,
            prompt_tokens=_count(getattr(usage, "prompt_tokens", None)),
            cached_tokens=_count(getattr(details, "cached_tokens", None)),
            completion_tokens=_count(getattr(usage, "completion_tokens", None)),
        )
        with self._recent_lock:
            self._recent.append(record)

    def _retryable(self, e: Exception) -> bool:
        o = self._openai
        if isinstance(e, (o.APITimeoutError, o.APIConnectionError)):
            return True
        if isinstance(e, o.APIStatusError):
            return e.status_code >= 500 or e.status_code == 429
        return False

    async def _call(
        self,
        fn: Callable[[Any], Awaitable[T]],
        what: str,
        key: int | None = None,
        *,
        counted: bool = True,
    ) -> T:
        """Run ``fn(client)`` on the replica the router picks for ``key`` (None: the least
        loaded), failing over and backing off; ``counted``: a model call (``served``)."""
        assert self._router is not None
        errors: list[tuple[str, str]] = []  # (url, error)
        for attempt in range(self.max_retries + 1):
            rep = self._router.pick(key)
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
            rep.served += counted
            if counted:
                self._record(rep.url, what, key, out)
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
        """The model id (one ``GET /v1/models`` on the first call, whichever replica answers)
        and the context length that listing reports."""
        if not self._listed:

            async def listing(client: Any) -> tuple[str, list[tuple[str, int | None]] | None]:
                return str(client.base_url), await self._list_models(client)

            url, listed = await self._call(listing, "GET /v1/models", counted=False)
            self._take_listing(url, listed)
        assert self.model is not None
        return self.model

    async def _list_models(self, client: Any) -> list[tuple[str, int | None]] | None:
        """``(id, max_model_len)`` per model ``/v1/models`` lists; None when the server has no
        such route (404) and a model is named: then the name is taken on trust."""
        try:
            page = await client.models.list()
        except self._openai.NotFoundError:
            if self.model is None:
                raise
            return None
        out = []
        for m in page.data:
            extra = getattr(m, "model_extra", None) or {}
            length = extra.get("max_model_len")
            out.append((str(m.id), int(length) if isinstance(length, (int, float)) else None))
        return out

    def _take_listing(self, url: str, listed: list[tuple[str, int | None]] | None) -> int | None:
        """Choose (or confirm) the model from one server's listing; returns the context length
        it reports for that model."""
        self._listed = True
        if listed is None:
            return None
        model = choose_model([m for m, _ in listed], self.model, f"{self.name}: {url}")
        self.model = model
        if not self._named:
            self.name = model
        length = dict(listed)[model]
        if length is not None:
            known = self._reported_max_model_len
            self._reported_max_model_len = length if known is None else min(known, length)
        return length

    @property
    def max_model_len(self) -> int | None:
        """Prompt plus new tokens one request may hold: the ``max_model_len`` given, else the
        least any checked server reports in ``/v1/models`` (read on first use), else None."""
        if self._given_max_model_len is not None:
            return self._given_max_model_len
        if not self._listed:
            self._run(self._model)
        return self._reported_max_model_len

    # ---- start-up checks ------------------------------------------------------------------
    def check_servers(self, top_k: int | None = None) -> list[dict[str, Any]]:
        """Start-up checks against every replica: it is reachable, serves the model (see
        ``choose_model``), and its context length is read; with ``top_k`` (the gate's K) one
        probe request counts the finite top logprobs it really returns, and fewer than
        ``top_k`` is refused (BackendError) with the measured number and the server flag that
        raises it. Returns ``replica_stats()``."""
        if top_k is not None:
            self._check_top_k(top_k)
        return self._run(lambda: self._check_all(top_k))

    async def _check_all(self, top_k: int | None) -> list[dict[str, Any]]:
        assert self._model_lock is not None
        async with self._model_lock:
            for rep in self._replicas:  # in order: the first fixes the model for the others
                try:
                    listed = await self._list_models(rep.client)
                except self._openai.OpenAIError as e:
                    raise BackendError(
                        f"{self.name}: start-up check of {rep.url} failed: "
                        f"{type(e).__name__}: {_short(e)}"
                    ) from e
                rep.max_model_len = self._take_listing(rep.url, listed)
        if top_k is not None:
            await asyncio.gather(*(self._probe_logprobs(r, top_k) for r in self._replicas))
        return self.replica_stats()

    async def _probe_logprobs(self, rep: Replica, top_k: int) -> None:
        ask = min(self.max_logprobs, top_k + _LOGPROB_SLACK)  # as answer() asks
        try:
            resp = await rep.client.chat.completions.create(
                model=self.model,
                messages=_PROBE_MESSAGES,
                max_tokens=1,
                temperature=0.0,
                logprobs=True,
                top_logprobs=ask,
                extra_body=self.extra_body or None,
            )
        except self._openai.OpenAIError as e:
            raise BackendError(
                f"{self.name}: {rep.url} refused a request for top_logprobs={ask} "
                f"({type(e).__name__}: {_short(e)}). Start the server with a cap of at least "
                f"{ask} (vLLM: --max-logprobs {ask}), or pass a lower --max-logprobs and --top-k."
            ) from e
        content = self._content(resp.choices[0]) if resp.choices else []
        if not content:
            log.warning("%s: %s returned no logprobs to count", self.name, rep.url)
            return
        finite = sum(math.isfinite(_finite(t.logprob)) for t in content[0].top_logprobs or [])
        rep.finite_logprobs = finite
        if finite < top_k:
            raise BackendError(
                f"{self.name}: {rep.url} returned {finite} finite top logprobs of the {ask} "
                f"asked, fewer than the top-K {top_k} the gate needs. Raise the server's cap "
                f"(vLLM: --max-logprobs {max(ask, top_k)}; entries at -inf or -9999 mean the "
                f"server masks them after sampling: vLLM --logprobs-mode raw_logprobs), or pass "
                f"--top-k {finite} (and calibrate tau for that K)."
            )

    # ---- requests -------------------------------------------------------------------------
    async def _complete(
        self,
        messages: list[dict[str, Any]],
        what: str,
        affinity: int | None = None,
        **params: Any,
    ) -> Any:
        model = await self._model()
        assert self._sem is not None
        body = {**self.extra_body, **params.pop("extra_body", {})}
        if self.session_header and affinity is not None:
            params["extra_headers"] = {self.session_header: f"{affinity:016x}"}

        async def create(client: Any) -> Any:
            return await client.chat.completions.create(
                model=model, messages=messages, temperature=0.0, extra_body=body or None, **params
            )

        async with self._sem:
            resp = await self._call(create, what, affinity)
        if not resp.choices:
            raise BackendError(f"{self.name}: {what}: the server returned no choices")
        return resp

    def _send(self, batch: Sequence[Messages], what: str, **params: Any) -> list[Any]:
        """One request per conversation, all in flight together; responses in batch order."""
        # Images are resized and PNG-encoded in the caller's thread, not on the shared loop,
        # so a large image never stalls requests that are already in flight.
        converted = [self._convert(m) for m in batch]
        keys = [self._affinity_key(c) for c in converted]
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
            for c, key, extra in zip(converted, keys, extras, strict=True):
                kw = dict(params) if extra is None else {**params, "extra_body": extra}
                calls.append(self._complete(c, what, affinity=key, **kw))
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

    def _affinity_key(self, converted: list[dict[str, Any]]) -> int | None:
        """The key that ties the calls of one query together: a digest of the conversation's
        first image as sent (its data URI), else of its first user message; None if neither."""
        for m in converted:
            content = m["content"]
            for part in content if isinstance(content, list) else ():
                if part.get("type") == "image_url":
                    return self._uri_digest(part["image_url"]["url"])
        for m in converted:
            if m["role"] == "user":
                return digest(json.dumps(m["content"], sort_keys=True))
        return None

    def _uri_digest(self, uri: str) -> int:
        with self._cache_lock:  # the same cached URI object hashes and compares in O(1)
            hit = self._key_cache.get(uri)
            if hit is not None:
                self._key_cache.move_to_end(uri)
                return hit
        key = digest(uri)
        with self._cache_lock:
            self._key_cache[uri] = key
            while len(self._key_cache) > 256:
                self._key_cache.popitem(last=False)
        return key

    def _convert(self, messages: Messages) -> list[dict[str, Any]]:
        """speceyes image parts -> OpenAI ``image_url`` parts; text and strings unchanged."""
        return map_images(
            messages, lambda src: {"type": "image_url", "image_url": {"url": self._data_uri(src)}}
        )

    # ---- logprobs -------------------------------------------------------------------------
    def _check_top_k(self, top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        measured = [r.finite_logprobs for r in self._replicas if r.finite_logprobs is not None]
        if measured and top_k > min(measured):
            raise ValueError(
                f"top_k={top_k} exceeds the {min(measured)} finite top logprobs the server "
                f"returns (measured at start-up); raise its cap (vLLM: --max-logprobs {top_k}) "
                f"or use top_k <= {min(measured)}"
            )
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
    """A logprob as a float; None (some servers for -inf) and vLLM's -9999.0 become -inf."""
    return -math.inf if x is None or x <= _SERVER_NEG_INF else float(x)


def _count(x: Any) -> int | None:
    """A token count from a server's usage object; None where it gives none."""
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _short(e: BaseException, limit: int = 300) -> str:
    s = str(e).replace("\n", " ").strip()
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in s:
        # "Connection error." alone hides "connection refused" vs a DNS or TLS failure.
        s = f"{s.rstrip('.')} ({type(cause).__name__}: {str(cause).strip()})"
    return s if len(s) <= limit else s[: limit - 3] + "..."
