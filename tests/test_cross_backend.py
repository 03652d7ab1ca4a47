"""One model, three runtimes, the same funnel: transformers, vLLM's offline engine, vLLM's server.

The bundled mini-world large model answers a few level-1 mini-world questions through the whole
funnel in ``both`` mode (judge, speculative answer, gate, and the manifest's search agent for
every query), built from the public entry points: ``factory.make_backend`` for transformers,
``VLLMBackend`` for the offline engine, ``factory.make_backend`` for the server's URL, and
``factory.assemble_funnel`` over each (the model plays both roles). Under greedy decoding the
runtimes must agree: same answers, routes and tool calls, gate confidences and judge
probabilities within 1e-3.

The server's client is given the model folder's pixel limits (a client cannot read them from a
URL: the CLI's ``--large-min-pixels``/``--large-max-pixels``); the offline engine is given nothing, and must
find them in the folder as transformers does.

Runs under the vLLM environment's interpreter (see tests/vllm_support.py).
"""

from __future__ import annotations

import math

import pytest

from speceyes import factory
from speceyes.miniworld import demo
from tests.vllm_support import (
    MAX_IMAGES,
    MAX_LOGPROBS,
    SERVED_MODEL,
    engine_kwargs,
    require_vllm_import,
    shutdown_engine,
)

require_vllm_import(__file__)

ATOL = 1e-3
EXACT = ("route", "answer", "small_answer", "agent_answer", "judge_tool", "tool_calls", "error")
CLOSE = ("confidence", "p_tool")


def funnel_over(backend):
    """The mini-world demo's funnel settings (manifest) in ``both`` mode over ``backend``."""
    s = factory.Settings.from_manifest(demo.MODELS_DIR / factory.MANIFEST)
    return factory.build_funnel(s.with_funnel(mode="both"), backends=(backend, backend))


def differences(ref: list, got: list) -> list[str]:
    """Every field where ``got`` departs from ``ref``, one line each (empty: they agree)."""
    out = []
    for r, g in zip(ref, got, strict=True):
        for f in EXACT:
            if getattr(r, f) != getattr(g, f):
                out.append(f"{r.id} {f}: {getattr(r, f)!r} vs {getattr(g, f)!r}")
        for f in CLOSE:
            a, b = getattr(r, f), getattr(g, f)
            if (a is None) != (b is None) or (
                a is not None and not math.isclose(a, b, abs_tol=ATOL)
            ):
                out.append(f"{r.id} {f}: {a} vs {b}")
    return out


@pytest.fixture(scope="module")
def reference(miniworld_queries):
    hf = factory.make_backend(str(SERVED_MODEL), settings=factory.BackendSettings(dtype="float32"))
    results = funnel_over(hf).run(miniworld_queries)
    assert all(r.error is None for r in results)
    assert {r.route for r in results} >= {"small"}  # the gate accepts some: a real comparison
    return hf, results


def test_offline_engine_agrees_with_transformers(reference, miniworld_queries):
    from speceyes.backends.vllm import VLLMBackend

    hf, ref = reference
    engine = VLLMBackend(
        str(SERVED_MODEL), dtype="float32", max_logprobs=MAX_LOGPROBS, max_images=MAX_IMAGES,
        **engine_kwargs(),
    )  # fmt: skip
    try:
        view = (engine.min_pixels, engine.max_pixels)
        got = funnel_over(engine).run(miniworld_queries)
    finally:
        shutdown_engine(engine)
    diffs = differences(ref, got)
    assert not diffs, (
        f"vLLM offline (pixels {view}) vs transformers (pixels {(hf.min_pixels, hf.max_pixels)}):"
        "\n" + "\n".join(diffs)
    )


def test_server_agrees_with_transformers(reference, vllm_server, miniworld_queries):
    hf, ref = reference
    # As the CLI builds it from --max-logprobs 64 --large-min-pixels ... --large-max-pixels ...
    settings = factory.BackendSettings(
        max_logprobs=MAX_LOGPROBS, large_min_pixels=hf.min_pixels, large_max_pixels=hf.max_pixels
    )
    with factory.make_backend(vllm_server.url, hf.family, settings) as served:
        got = funnel_over(served).run(miniworld_queries)
    diffs = differences(ref, got)
    assert not diffs, "vLLM server vs transformers:\n" + "\n".join(diffs)
