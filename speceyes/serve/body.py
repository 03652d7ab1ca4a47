"""A request body in, bounded: read against a deadline and a server-wide byte budget on the event
loop, then inflated (gzip, deflate) and parsed as JSON in the decoder threads, never past the
size limit.

The HTTP parser's own decompression is off (``auto_decompress=False`` in ``create_app``): it
would inflate on the event loop, and answer an encoding it does not know in plain text.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from speceyes.serve.request import RequestError

# Content-Encoding values a body may have, and the zlib window bits that inflate them
# (None: deflate, where the zlib wrapper is sniffed: some clients send raw deflate).
ENCODINGS: dict[str, int | None] = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                                    "deflate": None}  # fmt: skip
MAX_GZIP_MEMBERS = 64  # concatenated gzip members in one body


class ClientGone(Exception):
    """The client closed the connection before its body was in: there is no one to answer."""


@dataclass
class ByteBudget:
    """Bytes all request bodies being read and parsed hold (received, and inflated); used on
    the event loop only."""

    limit: int
    used: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class Body:
    """One request's body as received, and the bytes it holds in the budget."""

    data: bytearray
    encoding: str | None  # a key of ENCODINGS; None: identity
    budget: ByteBudget
    charged: int = 0
    _released: bool = field(default=False, repr=False)

    def charge(self, n: int) -> None:
        if not self.budget.take(n):
            raise _busy(self.budget)
        self.charged += n

    def release(self) -> None:
        """Give the bytes back (once): the body is parsed and its image decoded, or refused."""
        if not self._released:
            self._released = True
            self.budget.give(self.charged)
            self.charged = 0
            self.data = bytearray()


def _busy(budget: ByteBudget) -> RequestError:
    return RequestError(
        "server busy: the request bodies being read fill its memory budget "
        f"({budget.limit} bytes); retry later",
        status=429,
        code="body_budget",
        type="rate_limit_error",
    )


def _too_large(limit: int, what: str = "the request body") -> RequestError:
    return RequestError(
        f"{what} is larger than this server accepts ({limit} bytes)",
        status=413,
        code="request_too_large",
    )


def content_encoding(request: web.BaseRequest) -> str | None:
    """The body's encoding (None: identity); 415 for one this server does not inflate."""
    raw = request.headers.get("Content-Encoding", "").strip().lower()
    if raw in ("", "identity"):
        return None
    if raw in ENCODINGS:
        return raw
    raise RequestError(
        f"Content-Encoding {raw!r} is not supported: send the body as it is, or gzip or deflate it",
        status=415,
        code="unsupported_content_encoding",
    )


async def read_body(
    request: web.BaseRequest, *, max_bytes: int, timeout: float, budget: ByteBudget
) -> Body:
    """The whole body within ``timeout`` seconds (408 beyond), each chunk charged to ``budget``
    as it arrives (429 when spent: what a slow client holds is what it has sent), at most
    ``max_bytes`` (413). A client that disconnects mid-body raises ClientGone."""
    body = Body(bytearray(), content_encoding(request), budget)
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    complete = False
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                if len(body.data) + len(chunk) > max_bytes:
                    raise _too_large(max_bytes)
                body.charge(len(chunk))
                body.data += chunk
        complete = True
    except TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {timeout:g} s",
            status=408,
            code="body_timeout",
        ) from None
    except ConnectionError as e:  # aiohttp: "Connection lost"
        raise ClientGone(str(e)) from None
    except RequestPayloadError as e:  # a malformed chunked body, or a short Content-Length
        raise RequestError(
            f"the request body could not be read ({e})", code="invalid_body"
        ) from None
    finally:
        if not complete:
            body.release()
    return body


def inflate(data: bytes | bytearray, encoding: str, max_bytes: int) -> bytearray:
    """``data`` inflated, refused (413) as soon as the output passes ``max_bytes``: a body that
    would inflate to a gigabyte costs ``max_bytes``, never more."""
    wbits = ENCODINGS[encoding]
    if wbits is None:  # deflate: zlib-wrapped (RFC 1950) when the first byte says so, else raw
        wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
    out = bytearray()
    rest: bytes | bytearray = data
    try:
        for _ in range(MAX_GZIP_MEMBERS):
            d = zlib.decompressobj(wbits)
            while rest and not d.eof:
                # max_length >= 1 always: 0 would mean "no limit" to zlib.
                out += d.decompress(rest, max_bytes + 1 - len(out))
                if len(out) > max_bytes:
                    raise _too_large(max_bytes, "the inflated request body")
                rest = d.unconsumed_tail
            if not d.eof:
                raise RequestError(f"the {encoding} request body is truncated", code="invalid_body")
            rest = d.unused_data
            if not rest or wbits <= zlib.MAX_WBITS:  # only gzip has members after the first
                break
        else:
            raise RequestError(f"more than {MAX_GZIP_MEMBERS} gzip members", code="invalid_body")
    except zlib.error as e:
        raise RequestError(
            f"the {encoding} request body is corrupt ({e})", code="invalid_body"
        ) from None
    if rest and rest.strip():
        raise RequestError(f"data after the {encoding} stream", code="invalid_body")
    return out


def json_values_bound(data: bytes | bytearray) -> int:
    """An upper bound, in three C-speed scans, on the JSON values that need their own object
    (every element after the first is behind a comma, every container opens with a bracket);
    commas inside strings only make it larger."""
    return data.count(b",") + data.count(b"[") + data.count(b"{") + 1


def decode_json(
    data: bytes | bytearray, encoding: str | None, *, max_bytes: int, max_values: int
) -> Any:
    """The body's JSON (in a decoder thread: a large body never stalls the event loop)."""
    if encoding is not None:
        data = inflate(data, encoding, max_bytes)
    values = json_values_bound(data)
    if values > max_values:
        raise RequestError(
            f"the request body holds up to {values} JSON values; a chat request needs a few "
            f"dozen and this server parses at most {max_values}",
            status=413,
            code="request_too_complex",
        )
    try:
        return json.loads(data)
    except RecursionError as e:
        raise RequestError("the request body is nested too deeply", code="invalid_json") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from e
