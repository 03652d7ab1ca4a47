"""``speceyes serve``: an OpenAI-compatible HTTP server that answers through the funnel."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from speceyes import limits
from speceyes.cli.options import add_funnel_args, add_model_args
from speceyes.scale.ray_serve import add_ray_serve_args

if TYPE_CHECKING:
    from speceyes.serve import ServeSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server that answers through the funnel",
        description="POST /v1/chat/completions (one image part as a data URI, a text part, "
        'optional "options": [...]), GET /health, /v1/models, /metrics. Concurrent requests '
        "are micro-batched (up to --batch-size, or what arrives within --max-wait-ms).",
    )
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    srv.add_argument("--max-queue", type=int, default=256, help="queued requests before 429")
    srv.add_argument("--max-wait-ms", type=float, default=10.0, help="micro-batch wait")
    srv.add_argument("--request-timeout", type=float, default=300.0, help="seconds before 504")
    srv.add_argument("--model-name", default="speceyes", help="model id in /v1/models")
    srv.add_argument(
        "--max-body-mb", type=float, default=limits.MAX_BODY_MB, help="largest request body"
    )
    srv.add_argument("--allow-local-files", action="store_true", help="accept file:// image URLs")
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise); "
        "default: the SPECEYES_API_KEY environment variable, else no key",
    )
    srv.add_argument(
        "--max-question-chars",
        type=int,
        default=limits.MAX_QUESTION_CHARS,
        help="longest question accepted (413 beyond)",
    )
    srv.add_argument(
        "--max-option-chars",
        type=int,
        default=limits.MAX_OPTION_CHARS,
        help=f"longest option accepted (413 beyond); at most {limits.MAX_OPTIONS} options (400)",
    )
    srv.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.MAX_IMAGE_PIXELS,
        help="largest image (width x height, read from its header before decoding; 413 beyond)",
    )
    srv.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=limits.MAX_PIXELS_IN_FLIGHT,
        help="decoded image pixels all admitted requests may hold at once (429 beyond)",
    )
    srv.add_argument(
        "--max-text-tokens",
        type=int,
        default=limits.MAX_TEXT_TOKENS,
        help="question + options, in the served models' tokens (UTF-8 bytes for a URL model)",
    )
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=limits.BODY_TIMEOUT_S,
        help="seconds a client has to send its request body (408 beyond)",
    )
    srv.add_argument(
        "--max-body-mb-in-flight",
        type=float,
        default=limits.MAX_BODY_MB_IN_FLIGHT,
        help="request-body MB all requests being read may hold at once (429 beyond)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=limits.DRAIN_TIMEOUT_S,
        help="on SIGTERM/Ctrl-C: seconds to answer admitted requests before exiting",
    )
    add_model_args(srv)
    # Accepted answers leave as soon as the gate accepts them, not after their batch-mates.
    add_funnel_args(srv, schedule="pipelined")
    add_ray_serve_args(srv)
    srv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.factory import Settings, build_funnel
    from speceyes.serve import serve

    # Fail on bad server settings before minutes of model loading (the batch size is the
    # funnel's, known once it is built).
    serve_settings(args, None).validate()
    if getattr(args, "ray", None) is not None:  # the same app as a Ray Serve deployment graph
        from speceyes.scale.ray_serve import run_ray_serve

        return run_ray_serve(args)
    funnel = build_funnel(Settings.from_args(args))
    return serve(funnel, serve_settings(args, funnel.config.batch_size))


def serve_settings(args: argparse.Namespace, batch_size: int | None) -> ServeSettings:
    """The server settings the ``serve`` flags give (the API key also from the environment)."""
    from speceyes.serve import API_KEY_ENV, ServeSettings

    return ServeSettings(
        host=args.host,
        port=args.port,
        batch_size=batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        model_name=args.model_name,
        request_timeout=args.request_timeout,
        allow_local_files=args.allow_local_files,
        max_body_mb=args.max_body_mb,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_question_chars=args.max_question_chars,
        max_option_chars=args.max_option_chars,
        max_image_pixels=args.max_image_pixels,
        max_pixels_in_flight=args.max_pixels_in_flight,
        drain_timeout=args.drain_timeout,
        max_text_tokens=args.max_text_tokens,
        body_timeout=args.body_timeout,
        max_body_mb_in_flight=args.max_body_mb_in_flight,
    )
