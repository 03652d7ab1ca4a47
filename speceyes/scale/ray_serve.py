"""The funnel as a Ray Serve application: ``speceyes serve --ray ADDRESS``, or
``serve run speceyes.scale.ray_serve:build_app small=MODEL large=MODEL [FLAG=VALUE ...]``.

Three deployments, each scaled on its own::

    Ray Serve proxy (HTTP) --> "funnel" ingress: judge -> small -> gate -> agent loop
                                 |-- handle --> "small" deployment (the tool-free VLM)
                                 `-- handle --> "large" deployment (the agentic VLM)

* ``small`` and ``large`` (:class:`ModelServer`) hold one speceyes backend each (a model folder
  or hub id in process, on ``--small-gpus``/``--large-gpus`` GPUs per replica, or the URL of an
  OpenAI-compatible server) and answer the backend's methods.
* ``funnel`` (:class:`FunnelIngress`) builds the funnel over :class:`DeploymentBackend` proxies
  of those handles and serves it with :func:`speceyes.serve.create_app`, the very app
  ``speceyes serve`` runs: the same OpenAI-compatible API, request parsing, limits, API key,
  micro-batching, /health, /v1/models and /metrics. Each ingress replica runs that app on a
  Unix socket of its own and passes the requests Ray Serve's proxy gives it on to it, so the
  limits (queue, pixel budget) hold per ingress replica.

The Ray Serve flags mirror ``speceyes serve``'s; ``serve run`` takes them as ``key=value``
(``small=...``, ``tau=0.9``, ``small_replicas=2``, ``overlap=true``). Images travel to the model
replicas through Ray's object store as decoded pixels. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speceyes.factory import BackendSettings, Settings, make_backend
from speceyes.images import View, load_image, view_for_model
from speceyes.scale.session import connect, require_ray

if TYPE_CHECKING:
    from speceyes.backends.base import Messages
    from speceyes.serve import ServeSettings
    from speceyes.types import ChatTurn, SpecAnswer

__all__ = [
    "DeploymentBackend",
    "FunnelIngress",
    "ModelServer",
    "add_ray_serve_args",
    "build_app",
    "funnel_app",
    "run_ray_serve",
]

APP_NAME = "speceyes"
# What a backend declares besides its methods (speceyes.backends.base.Backend).
BACKEND_ATTRIBUTES = (
    "name",
    "box_coords",
    "factor",
    "min_pixels",
    "max_pixels",
    "scores",
    "max_images",
    "max_logprobs",
)
# Headers that belong to one connection, not to the request or answer passed on.
HOP_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te",
     "upgrade", "accept-encoding", "content-encoding", "date", "server"}
)  # fmt: skip


def add_ray_serve_args(parser: argparse.ArgumentParser) -> None:
    """``--ray`` and the sizes of the three deployments (read only with ``--ray``)."""
    g = parser.add_argument_group("ray serve (with --ray; needs the extra speceyes[ray])")
    g.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="serve as a Ray Serve app on the Ray cluster at ADDRESS (auto: this machine's; "
        "local: start Ray here); --host/--port are then Ray Serve's HTTP proxy's",
    )
    for role in ("small", "large", "funnel"):
        g.add_argument(
            f"--{role}-replicas", type=int, default=1, help=f"{role} deployment replicas"
        )
    for role in ("small", "large"):
        g.add_argument(
            f"--{role}-gpus",
            type=float,
            default=0.0,
            help=f"GPUs per {role} replica (in-process hf models then default to "
            "--device-map auto)",
        )
    g.add_argument("--model-cpus", type=float, default=1.0, help="CPUs per model replica")


# ---- the model deployments ----------------------------------------------------------------
class ModelServer:
    """A Ray Serve deployment holding one backend; its calls run one at a time per replica, in
    a thread, so the replica's event loop stays free for Ray's own calls."""

    def __init__(self, spec: str, family: str, backend: BackendSettings) -> None:
        self.backend = make_backend(spec, family, backend)
        self._turn = asyncio.Lock()

    def info(self) -> dict[str, Any]:
        return {name: getattr(self.backend, name) for name in BACKEND_ATTRIBUTES}

    async def call(self, method: str, *args: Any) -> Any:
        if method not in ("answer", "chat", "next_token_probs"):
            raise ValueError(f"not a backend method: {method!r}")
        async with self._turn:
            return await asyncio.to_thread(getattr(self.backend, method), *args)


class DeploymentBackend:
    """A backend whose model calls go to a :class:`ModelServer` deployment through its handle
    (blocking: the funnel calls backends from its own threads, never from an event loop).
    ``info`` is the deployment's ``info()``: the capabilities and geometry it declares."""

    def __init__(self, handle: Any, info: dict[str, Any]) -> None:
        self.handle = handle
        for name in BACKEND_ATTRIBUTES:
            setattr(self, name, info[name])

    def _call(self, method: str, *args: Any) -> Any:
        return self.handle.call.remote(method, *args).result()

    def view_of(self, image: Any) -> View:
        # The geometry alone decides it: computed here, no round trip.
        return view_for_model(load_image(image), self.factor, self.min_pixels, self.max_pixels)

    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        return self._call("next_token_probs", list(batch), list(words), top_logprobs)

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        return self._call("answer", list(batch), max_new_tokens, top_k)

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        return self._call("chat", list(batch), list(stop), max_new_tokens)


# ---- the ingress --------------------------------------------------------------------------
class FunnelIngress:
    """The Ray Serve ingress: ``speceyes serve``'s app over the model deployments' handles."""

    async def __init__(
        self, small: Any, large: Any, settings: Settings, serve_settings: ServeSettings
    ) -> None:
        import aiohttp
        from aiohttp import web

        from speceyes.factory import build_funnel
        from speceyes.serve import create_app

        proxies: dict[str, DeploymentBackend] = {}  # one proxy per deployment
        for handle in (small, large):
            if handle is not None and handle.deployment_name not in proxies:
                info = await handle.info.remote()
                proxies[handle.deployment_name] = DeploymentBackend(handle, info)
        backends = tuple(None if h is None else proxies[h.deployment_name] for h in (small, large))
        self.funnel = build_funnel(settings, backends=backends)
        self.socket_dir = tempfile.mkdtemp(prefix="speceyes-")
        socket = str(Path(self.socket_dir) / "serve.sock")
        self.runner = web.AppRunner(create_app(self.funnel, serve_settings), access_log=None)
        await self.runner.setup()
        await web.UnixSite(self.runner, socket).start()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket),
            timeout=aiohttp.ClientTimeout(total=None),  # the app's own request timeout holds
            auto_decompress=False,
        )

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        path = request.url.path
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        target = "http://speceyes" + path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self.session.request(
            request.method, target, data=await request.body(), headers=headers
        ) as resp:
            body = await resp.read()
            kept = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            return Response(content=body, status_code=resp.status, headers=kept)

    async def __del__(self) -> None:
        await self.session.close()
        await self.runner.cleanup()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


# ---- the application ----------------------------------------------------------------------
def funnel_app(args: argparse.Namespace) -> Any:
    """The Ray Serve application the ``serve`` flags ``args`` describe (not yet running)."""
    require_ray()
    from ray import serve

    from speceyes.cli.serve import serve_settings

    settings = Settings.from_args(args)  # a calibration file is read here, on the driver
    resolved = settings.resolved()
    mode = resolved.funnel.mode
    small = large = None
    if mode != "agent":
        small = _model("small", settings.small, settings.small_family, args, settings.backend)
    if mode != "small":
        same = settings.large == settings.small and small is not None
        large = (
            small
            if same
            else _model("large", settings.large, settings.large_family, args, settings.backend)
        )
    web_settings = serve_settings(args, resolved.funnel.batch_size)
    f = resolved.funnel
    ingress = serve.deployment(FunnelIngress).options(
        name="funnel",
        num_replicas=args.funnel_replicas,
        ray_actor_options={"num_cpus": 0},  # waits on the models; the gate is light
        # Admission is the app's (429 past --max-queue): Ray Serve passes everything on.
        max_ongoing_requests=web_settings.max_queue + f.batch_size + f.max_agent_loops,
    )
    return ingress.bind(small, large, settings, web_settings)


def _model(
    role: str, spec: str | None, family: str, args: argparse.Namespace, backend: BackendSettings
) -> Any:
    from ray import serve

    if spec is None:
        raise ValueError(f"mode {args.mode!r} needs the {role} model")
    gpus = getattr(args, f"{role}_gpus")
    if gpus and backend.engine == "hf" and backend.device_map is None:
        backend = replace(backend, device_map="auto")  # the replica sees only its own GPUs
    options: dict[str, Any] = {"num_cpus": args.model_cpus}
    if gpus:
        options["num_gpus"] = gpus
    return (
        serve.deployment(ModelServer)
        .options(
            name=role, num_replicas=getattr(args, f"{role}_replicas"), ray_actor_options=options
        )
        .bind(_local_path(spec), family, backend)
    )


def _local_path(spec: str) -> str:
    """A model folder made absolute (replicas start in another directory); else as given."""
    return str(Path(spec).absolute()) if Path(spec).exists() else spec


def build_app(args: dict[str, str]) -> Any:
    """The application builder for ``serve run speceyes.scale.ray_serve:build_app KEY=VALUE``:
    each key is a ``speceyes serve`` flag (``small_replicas`` for ``--small-replicas``; a
    value of true/false for a flag that takes none)."""
    from speceyes.cli import build_parser

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() in ("true", "false"):
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, str(value)]
    return funnel_app(build_parser().parse_args(argv))


def run_ray_serve(args: argparse.Namespace) -> int:
    """``speceyes serve --ray``: run the app until Ctrl-C or SIGTERM, then take it down."""
    ray = require_ray()
    from ray import serve

    if args.port == 0:
        raise ValueError("Ray Serve's proxy needs a fixed --port (0 is not supported)")
    app = funnel_app(args)
    started = connect(args.ray)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(
            f"speceyes serve --ray: listening on http://{args.host}:{args.port} (POST "
            f"/v1/chat/completions); Ray Serve app {APP_NAME!r}; Ctrl-C to stop",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        if started:
            serve.shutdown()
            ray.shutdown()
    return 0
