"""A chat request in: its JSON bounded (text lengths in characters and in the served models'
tokens, no control tokens, option count, one image), the image URL resolved, the image's size,
mode and decoding cost read from its header before anything is decoded; and the OpenAI-style
error bodies a refused request gets."""

from __future__ import annotations

import io
import math
import sys
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from PIL import Image

from speceyes import limits
from speceyes.images import MAX_RATIO, ImageHeader, _decode_data_uri, header_of
from speceyes.usertext import TextRules, UserTextError


# ---- errors -------------------------------------------------------------------------------
class RequestError(Exception):
    """A request we answer with an OpenAI-style error body instead of a result."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = (
            message,
            status,
            code,
            param,
            type,
        )


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _error_from(e: RequestError) -> web.Response:
    return error_response(e.status, e.message, code=e.code, type=e.type, param=e.param)


def internal_error(request_id: str) -> web.Response:
    """A 500 that tells the client nothing about the internals, only the id in the server log."""
    return error_response(
        500, f"internal error (request id {request_id})", code="internal_error",
        type="server_error",
    )  # fmt: skip


# ---- request parsing ----------------------------------------------------------------------
@dataclass
class ChatRequest:
    question: str
    image_url: str
    options: list[str] | None = None


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return content
    raise RequestError(
        f"{where}.content must be a string or a list of content parts",
        code="invalid_content",
        param=where,
    )


def _image_url_of(part: dict[str, Any], where: str) -> str:
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise RequestError(
            f"{where}: an image_url part needs "
            '{"image_url": {"url": "data:image/...;base64,..."}}',
            code="invalid_image_url",
            param=where,
        )
    return url


def _check_text(text: str, where: str) -> str:
    # Valid JSON can carry a lone surrogate ("\ud800"); no tokenizer encodes one.
    if limits.lone_surrogate(text):
        raise RequestError(
            f"{where} contains a lone UTF-16 surrogate (not valid Unicode text)",
            code="invalid_text",
            param=where,
        )
    return text


def _check_user_text(text: str, where: str, rules: TextRules) -> str:
    """Text the models will read: valid Unicode, and no control token of their template."""
    _check_text(text, where)
    try:
        return rules.check(text, where)
    except UserTextError as e:
        raise RequestError(str(e), code="control_token", param=where) from e


def _too_long(what: str, n: int, cap: int, code: str, param: str) -> RequestError:
    return RequestError(
        f"{what} has {n} characters; this server accepts at most {cap}",
        status=413,
        code=code,
        param=param,
    )


def parse_chat_request(
    body: Any,
    *,
    max_question_chars: int = limits.MAX_QUESTION_CHARS,
    max_option_chars: int = limits.MAX_OPTION_CHARS,
    max_text_tokens: int = limits.MAX_TEXT_TOKENS,
    rules: TextRules | None = None,
) -> ChatRequest:
    """The question, the one image URL and the options of an OpenAI chat request.

    ``rules`` are the served models' control tokens and token counters (default: none known,
    so only ``<|...|>``-shaped control tokens are refused and tokens are bounded by UTF-8
    bytes). The question and its options together may have ``max_text_tokens`` (413 beyond).
    """
    rules = rules or TextRules()
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_body")
    if body.get("stream"):
        raise RequestError(
            "streaming is not supported: send stream=false",
            code="unsupported_stream",
            param="stream",
        )
    if body.get("n") not in (None, 1):
        raise RequestError("only n=1 is supported", code="unsupported_n", param="n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages must be a non-empty list", code="missing_messages", param="messages"
        )
    images: list[str] = []
    question = ""
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(
                f"{where} must be an object with a role", code="invalid_message", param=where
            )
        if m["role"] != "user":
            continue  # the funnel uses its own system prompts; earlier assistant turns do not apply
        texts = []
        for j, part in enumerate(_content_parts(m.get("content"), where)):
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"{where}.content[{j}].text must be a string",
                        code="invalid_content",
                        param=where,
                    )
                texts.append(_check_user_text(part["text"], f"{where}.content[{j}].text", rules))
            elif kind == "image_url":
                images.append(_check_text(_image_url_of(part, f"{where}.content[{j}]"), where))
            else:
                raise RequestError(
                    f"{where}.content[{j}]: unsupported content part type {kind!r} "
                    "(use 'text' and 'image_url')",
                    code="invalid_content",
                    param=where,
                )
        text = "\n".join(t for t in texts if t.strip()).strip()
        if text:
            question = text  # the last user message with text is the question
    if not images:
        raise RequestError(
            "the user message needs an image part: "
            '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}',
            code="missing_image",
            param="messages",
        )
    if len(images) > 1:
        raise RequestError(
            f"exactly one image per request is supported, got {len(images)}",
            code="too_many_images",
            param="messages",
        )
    if not question:
        raise RequestError(
            "the user message needs a text part with the question",
            code="missing_text",
            param="messages",
        )
    if len(question) > max_question_chars:
        n = len(question)
        raise _too_long("the question", n, max_question_chars, "question_too_long", "messages")
    options = body.get("options")
    if options is not None:
        if not isinstance(options, list) or not all(
            isinstance(o, str) and o.strip() for o in options
        ):
            raise RequestError(
                f"options must be a list of 1 to {limits.MAX_OPTIONS} non-empty strings",
                code="invalid_options",
                param="options",
            )
        if not 1 <= len(options) <= limits.MAX_OPTIONS:
            raise RequestError(
                f"got {len(options)} options; the prompts have letters for 1 to "
                f"{limits.MAX_OPTIONS}",
                code="too_many_options" if options else "invalid_options",
                param="options",
            )
        for k, o in enumerate(options):
            if len(o.strip()) > max_option_chars:
                where = f"options[{k}]"
                n = len(o.strip())
                raise _too_long(where, n, max_option_chars, "option_too_long", "options")
        options = [
            _check_user_text(o.strip(), f"options[{k}]", rules) for k, o in enumerate(options)
        ]
    # Characters first (cheap, and they bound what the tokenizers are given), then tokens: an
    # emoji is one character and four tokens of a byte-level tokenizer.
    tokens = rules.tokens(question) + sum(rules.tokens(o) for o in options or ())
    if tokens > max_text_tokens:
        raise RequestError(
            f"the question and its options have {tokens} tokens; this server accepts at most "
            f"{max_text_tokens}",
            status=413,
            code="too_many_tokens",
            param="messages",
        )
    return ChatRequest(question=question, image_url=images[0], options=options or None)


def resolve_image(url: str, allow_local_files: bool) -> str | Path:
    """What load_image should open: the data URI itself, or a local path (when allowed)."""
    if url.startswith("data:"):
        return url
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "file":
        if not allow_local_files:
            raise RequestError(
                "file:// image URLs are disabled on this server (start it with "
                "--allow-local-files); send the image as a data:image/...;base64 URI",
                code="local_files_disabled",
                param="messages",
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise RequestError(
                f"file URL must name a local file (file:///path), got host {parts.netloc!r}",
                code="invalid_image_url",
                param="messages",
            )
        return Path(urllib.parse.unquote(parts.path))
    if scheme in ("http", "https"):
        # Fetching URLs from a server would let any client make it request arbitrary hosts.
        raise RequestError(
            "remote image URLs are not fetched by this server; send the image as a "
            "data:image/...;base64 URI",
            code="unsupported_image_url",
            param="messages",
        )
    raise RequestError(
        "image_url.url must be a data:image/...;base64 URI"
        + (" or a file:// URL" if allow_local_files else ""),
        code="invalid_image_url",
        param="messages",
    )


# ---- images: size, mode and cost from the header before decoding --------------------------
def _side(pixels: int) -> str:
    side = math.isqrt(pixels)
    return f"{side}x{side}"


def image_bytes(src: str | Path) -> bytes | Path:
    """The encoded image of a data URI (or the local path): nothing decoded yet."""
    return _decode_data_uri(src) if isinstance(src, str) else src


# What the pixel budgets charge for an image is its header's ``cost`` (speceyes.images: the
# memory its decode holds, in RGB-equivalent pixels), the rule load_image applies too.


TOO_MANY_PIXELS = ImageHeader(sys.maxsize, 1, "RGB")  # past PIL's own bomb limit: past ours too


def read_image_size(data: bytes | Path) -> ImageHeader | None:
    """Size and mode from the image header alone; None when PIL cannot read one (load_image
    then says what is wrong). Opening reads the header only: the pixels are never decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
                return header_of(img)
        except Image.DecompressionBombError:
            return TOO_MANY_PIXELS
        except Exception:
            return None


def check_image_size(size: ImageHeader, max_cost: int) -> None:
    """Refuse, before decoding, an image no model takes (aspect ratio past MAX_RATIO: 400) or
    one costing more than ``max_cost`` pixels to decode (413)."""
    ratio = max(size.width, size.height) / max(1, min(size.width, size.height))
    if size is not TOO_MANY_PIXELS and ratio > MAX_RATIO:
        raise RequestError(
            f"the image is {size.width}x{size.height}, an aspect ratio of {ratio:g}; "
            f"images are resized for the model only up to {MAX_RATIO:g}",
            code="invalid_image",
            param="messages",
        )
    if size.cost > max_cost:
        if size is TOO_MANY_PIXELS:
            what = "too many pixels"
        else:
            what = f"{size.width}x{size.height} = {size.pixels} pixels"
            if size.cost > size.pixels:
                what += f", counted as {size.cost} for its {size.mode} mode"
        raise RequestError(
            f"the image has {what}; this server decodes at most {max_cost} "
            f"(e.g. {_side(max_cost)} RGB)",
            status=413,
            code="image_too_large",
            param="messages",
        )


def header_pixels(data: bytes | Path) -> int:
    """Width x height from the image header alone; 0 when PIL cannot read one."""
    size = read_image_size(data)
    return 0 if size is None else size.pixels
