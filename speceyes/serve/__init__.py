"""``speceyes serve``: an OpenAI-compatible HTTP server that answers through the funnel.

Endpoints:

* ``POST /v1/chat/completions`` - an OpenAI chat request whose user message holds one image part
  (``image_url`` with a ``data:image/...;base64,`` URI, or ``file://`` with --allow-local-files)
  and a text part (the question). Multiple-choice options go in the extra body field
  ``"options": [...]``. The reply is a standard ``chat.completion`` plus a top-level
  ``"speceyes"`` object (route, confidence, p_tool, tool calls, small answer, timings).
  System prompts, sampling parameters and ``max_tokens`` are ignored: the funnel uses its own
  prompts and greedy decoding, as the method requires.
* ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text format).

Scheduling: a request's body is read on the event loop (against a deadline and a byte budget),
then inflated, parsed, tokenized and its image decoded in a small thread pool, then queued. The funnel runs in one thread of its own, off the event loop
(``/health`` answers while it works), over a stream of micro-batches: whenever the funnel's
schedule is ready for another batch, the batcher hands it up to ``batch_size`` requests, or what
arrived within ``max_wait_ms`` of the oldest one. On the pipelined schedule (the CLI's default
for ``serve``) a batch is drawn as soon as the previous one passed phases I-III, and an answer
the gate accepted is sent at once instead of waiting for its batch-mates' agent loops.

Limits (defaults in :mod:`speceyes.limits`): the body's size (413, also once inflated: gzip
and deflate are inflated here, bounded while inflating; other encodings 415), its JSON values
(413), the time to send it (``body_timeout``, 408); question and option length in characters
(413) and, together, in tokens of the served models' tokenizers (413; UTF-8 bytes for a model
behind a URL); chat-template control tokens in user text (400, :mod:`speceyes.usertext`);
option count (400), lone surrogates (400); the image's decoding cost read from its header
before decoding (pixels, more for modes that decode into more bytes, 413) and its aspect ratio
(400); a server-wide budget of decoded pixels held by admitted requests (429 when spent).

Backpressure: bodies being read hold bytes in a server-wide budget (``max_body_mb_in_flight``,
429 when spent), never a queue slot, so slow clients cannot shut others out. Once its body is
in, a request is admitted if fewer than ``max_queue`` requests are admitted and not yet
running (else 429; when the queue is full already on arrival, before the body is read). Each
request has an end-to-end deadline (``request_timeout``, 504); a query whose request timed out
is dropped before the funnel starts it (or its agent loop).

Security: with ``api_key`` every endpoint but ``/health`` needs ``Authorization: Bearer <key>``
(401 otherwise), as vLLM and SGLang do. A 500 says only "internal error" and a request id; the
details are in the server log under that id (every response carries it as ``X-Request-Id``).
Shutdown (SIGTERM, Ctrl-C): stop accepting, answer what was admitted for up to
``drain_timeout`` seconds, then exit; the funnel thread never keeps the process alive.

Modules: :mod:`~speceyes.serve.body` (reading, inflating and decoding the body),
:mod:`~speceyes.serve.request` (parsing, limits, images, error bodies),
:mod:`~speceyes.serve.metrics`, :mod:`~speceyes.serve.state` (queue, batcher, funnel thread) and
:mod:`~speceyes.serve.app` (handlers, ``ServeSettings``, ``create_app``, ``serve``).
"""

from speceyes.serve.app import (
    API_KEY_ENV,
    CHAT_PATH,
    REQUEST_ID_HEADER,
    STATE_KEY,
    Server,
    ServeSettings,
    create_app,
    serve,
)
from speceyes.serve.metrics import Metrics
from speceyes.serve.request import (
    ChatRequest,
    RequestError,
    header_pixels,
    parse_chat_request,
    read_image_size,
    resolve_image,
)
from speceyes.serve.state import ServerState

__all__ = [
    "API_KEY_ENV",
    "CHAT_PATH",
    "REQUEST_ID_HEADER",
    "STATE_KEY",
    "ChatRequest",
    "Metrics",
    "RequestError",
    "ServeSettings",
    "Server",
    "ServerState",
    "create_app",
    "header_pixels",
    "parse_chat_request",
    "read_image_size",
    "resolve_image",
    "serve",
]
