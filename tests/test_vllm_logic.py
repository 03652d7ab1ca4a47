"""The vLLM backend's own logic on CPU, against stand-ins of vLLM's documented output types.

vLLM needs CUDA, so the engine never runs here. What the backend does with the engine's
outputs is tested against small stand-ins shaped like vLLM's ``RequestOutput`` (``outputs``: a
list of ``CompletionOutput``), ``CompletionOutput`` (``index``, ``text``, ``token_ids``,
``cumulative_logprob``, ``logprobs``, ``finish_reason``, ``stop_reason``) and ``Logprob``
(``logprob``, ``rank``, ``decoded_token``), where ``logprobs`` is one ``{token id: Logprob}``
dict per generated token: the sampled token plus the top ``SamplingParams.logprobs``. A stand-in
``vllm`` module (``LLM``, ``SamplingParams``) then runs the backend's methods end to end.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from PIL import Image

from speceyes import gate, prompts
from speceyes.backends import vllm as vb
from speceyes.images import smart_resize, to_data_uri
from speceyes.judging import JUDGE_LOGPROBS, p_tool_from_word_probs, tool_probability
from tests.conftest import make_scene


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True


def step_of(logits: np.ndarray, k: int, sampled: int | None = None) -> dict[int, Logprob]:
    """What vLLM returns for one token: the top-k logprobs (ranked) plus the sampled token."""
    lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    order = np.argsort(-lp)
    keep = [int(i) for i in order[:k]]
    if sampled is not None and sampled not in keep:
        keep.append(sampled)
    rank = {int(t): r + 1 for r, t in enumerate(order)}
    return {t: Logprob(float(lp[t]), rank[t], f"t{t}") for t in keep}


# ---- pure functions ---------------------------------------------------------------------------


def test_topk_rows_match_the_gate_on_full_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(3, 200))
    eos = 199
    k = 8
    # Step 1 samples a token ranked below k: vLLM adds it, the row must still be the top k.
    low = int(np.argsort(-logits[1])[50])
    steps = [step_of(logits[0], k), step_of(logits[1], k, sampled=low), step_of(logits[2], k)]
    ids = [int(np.argmax(logits[0])), low, eos]
    out = CompletionOutput(0, "ab", ids, None, steps)
    kept, rows = vb.topk_rows(out, k, {eos})
    assert kept == ids[:2] and rows.shape == (2, k)
    assert np.all(np.diff(rows, axis=1) <= 0)
    # Logprobs are logits minus a per-token constant: the same separability, the same score.
    full = gate.answer_confidence(logits[:2], top_k=k)
    assert gate.answer_confidence(rows, top_k=k) == pytest.approx(full, rel=1e-9)


def test_topk_rows_pad_short_steps_and_stop_at_eos():
    steps = [{5: Logprob(-0.1), 6: Logprob(-2.5)}, {2: Logprob(-0.01)}]
    kept, rows = vb.topk_rows(CompletionOutput(0, "x", [5, 2], None, steps), 3, {2})
    assert kept == [5] and rows.tolist() == [[-0.1, -2.5, -np.inf]]
    kept, rows = vb.topk_rows(CompletionOutput(0, "", [], None, []), 3, {2})
    assert kept == [] and rows.shape == (0, 3)


def test_judge_and_token_probabilities_from_one_step():
    step = {1: Logprob(math.log(0.3)), 2: Logprob(math.log(0.1)), 3: Logprob(math.log(0.2)),
            9: Logprob(math.log(0.05))}
    # yes ids {1, 2} sum to 0.4, no id {3} is 0.2: 0.4 / 0.6.
    words = np.array([vb.token_probs(step, [1, 2, None, None, None, None, 3, *[None] * 5])])
    assert p_tool_from_word_probs(words) == [pytest.approx(2 / 3)]
    # neither among the logprobs: undecided
    assert p_tool_from_word_probs(np.array([vb.token_probs(step, [7] * 6 + [8] * 6)])) == [0.5]
    np.testing.assert_allclose(vb.token_probs(step, [3, 42, 1, None]), [0.2, 0.0, 0.3, 0.0])
    request = RequestOutput("r", [CompletionOutput(0, "a", [1], None, [step])])
    assert vb.first_step(request) is step
    assert vb.first_step(RequestOutput("r", [CompletionOutput(0, "", [], None, None)])) == {}


def test_engine_messages_resize_every_image_form():
    img = make_scene(size=(1000, 600))
    parts = [
        prompts.image_part(img),
        {"type": "image_url", "image_url": {"url": to_data_uri(img)}},
        {"type": "image_url", "image_url": to_data_uri(img)},
        prompts.text_part("What color?"),
    ]
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": parts}]
    out = vb.engine_messages(msgs, 28, 4 * 28 * 28, 256 * 28 * 28)
    assert out[0] == {"role": "system", "content": "sys"}
    h, w = smart_resize(600, 1000, 28, 4 * 28 * 28, 256 * 28 * 28)
    images = [p["image_pil"] for p in out[1]["content"] if p["type"] == "image_pil"]
    assert len(images) == 3 and all(i.size == (w, h) for i in images)
    assert out[1]["content"][3] == prompts.text_part("What color?")
    assert isinstance(msgs[1]["content"][0]["image"], Image.Image)  # the input is not changed


# ---- the backend's methods over a stand-in engine ----------------------------------------------


class WordTokenizer:
    """One token per word of a fixed vocabulary (id = index); id 0 is EOS."""

    vocab = ["<eos>", "yes", "Yes", "no", "No", "red", "blue", *[str(d) for d in range(10)]]
    eos_token_id = 0
    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.index(w) for w in text.split() if w in self.vocab]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0


class LLM:
    """Greedy over fixed logits per conversation: the last user text picks the row. ``fail``
    (a class attribute) is raised at start, as vLLM's start-up checks raise."""

    fail: Exception | None = None

    def __init__(self, **kwargs: Any) -> None:
        if LLM.fail is not None:
            raise LLM.fail
        self.kwargs, self.calls = kwargs, []
        self.tok = WordTokenizer()

    def get_tokenizer(self) -> WordTokenizer:
        return self.tok

    def _logits(self, conv: list[dict]) -> np.ndarray:
        content = conv[-1]["content"]
        if isinstance(content, list):
            content = " ".join(p["text"] for p in content if p["type"] == "text")
        logits = np.random.default_rng(sum(map(ord, content))).normal(0, 2, len(self.tok.vocab))
        logits[0] = -10.0  # EOS comes only where chat() writes it
        return logits

    def chat(self, convs, params, use_tqdm=True, **kw):
        self.calls.append((len(convs), params, kw))
        outs = []
        for conv in convs:
            logits = self._logits(conv)
            ids, steps = [], []
            for j in range(params.max_tokens):
                t = int(np.argmax(logits)) if j < 2 else 0  # two words, then EOS
                steps.append(step_of(logits, params.logprobs or 1, sampled=t))
                ids.append(t)
                if t == 0:
                    break
                logits = np.roll(logits, 1)
            text = self.tok.decode(ids, skip_special_tokens=True)
            comp = CompletionOutput(0, text, ids, None, steps if params.logprobs else None,
                                    "stop" if ids[-1] == 0 else "length")
            outs.append(RequestOutput(str(len(outs)), [comp]))
        return outs


def stand_in_vllm(monkeypatch) -> types.ModuleType:
    """Install the stand-in ``vllm`` module (``LLM``, ``SamplingParams``) for one test."""
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(LLM, "fail", None)
    return fake


@pytest.fixture
def backend(monkeypatch):
    stand_in_vllm(monkeypatch)
    return vb.VLLMBackend("m", family="qwen2_5_vl", max_logprobs=12, max_images=3,
                          max_pixels=64 * 28 * 28)


def _conv(text: str) -> list[dict]:
    return [{"role": "user", "content": [prompts.image_part(make_scene()), prompts.text_part(text)]}]


def test_backend_contract_and_engine_settings(backend):
    from tests.tools.backend_contract import assert_backend_contract

    assert_backend_contract(backend)
    assert (backend.factor, backend.max_images, backend.max_logprobs) == (28, 3, 12)
    kw = backend.llm.kwargs
    assert kw["max_logprobs"] == 12 and kw["limit_mm_per_prompt"] == {"image": 3}
    assert kw["mm_processor_kwargs"] == {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}


def test_backend_methods_over_the_stand_in_engine(backend):
    tok, llm = backend.tokenizer, backend.llm
    batch = [_conv("first"), _conv("second")]
    # next_token_probs: one step with the engine's whole cap, P of each word's first token.
    p = backend.next_token_probs(batch, ["yes", "red", "7"])
    assert llm.calls[-1][1].max_tokens == 1 and llm.calls[-1][1].logprobs == 12
    for row, conv in zip(p, batch, strict=True):
        logits = llm._logits(backend._convert(conv))
        full = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        top = set(np.argsort(-full)[:12].tolist())
        want = [full[i] if i in top else 0.0 for i in map(tok.vocab.index, ["yes", "red", "7"])]
        np.testing.assert_allclose(row, want, rtol=1e-9)
    # The tool probability: the yes/no first-token ids of the engine's tokenizer, each once
    # (" yes" is "yes" to this tokenizer; "YES" is no token of it), over the judge's top 20.
    assert backend.scores == "logprobs"
    probs = backend.next_token_probs(batch, ["yes", "Yes", "no", "No"], top_logprobs=20)
    assert llm.calls[-1][1].logprobs == 12  # at most the engine's cap
    want = probs[:, :2].sum(1) / probs.sum(1)
    np.testing.assert_allclose(tool_probability(backend, batch), want, rtol=1e-9)
    assert llm.calls[-1][1].logprobs == min(JUDGE_LOGPROBS, 12)
    assert backend.next_token_probs(batch, ["yes", " yes", "YES"])[:, 1:].tolist() == [[0, 0]] * 2
    # answer: the text and top-K rows before EOS.
    a, b = backend.answer(batch, max_new_tokens=5, top_k=4)
    assert len(a.token_ids) == 2 and a.topk.shape == (2, 4) and 0 not in a.token_ids
    assert a.text == tok.decode(a.token_ids) and a.text != b.text
    with pytest.raises(ValueError, match="max_logprobs"):
        backend.answer(batch, top_k=13)


def test_continued_turns_go_in_their_own_call_and_results_keep_order(backend):
    cont = [*_conv("c"), {"role": "assistant", "content": "red", "continue": True}]
    batch = [_conv("a"), cont, _conv("b")]
    before = len(backend.llm.calls)
    turns = backend.chat(batch, stop=["</answer>"], max_new_tokens=1)
    calls = backend.llm.calls[before:]
    assert [(n, kw) for n, _, kw in calls] == [
        (2, {}), (1, {"add_generation_prompt": False, "continue_final_message": True})
    ]
    alone = [backend.chat([m], max_new_tokens=1)[0].text for m in batch]
    assert [t.text for t in turns] == alone and all(t.finish_reason == "length" for t in turns)


def test_tool_probability_reads_the_judges_top_logprobs_under_a_higher_cap(monkeypatch):
    stand_in_vllm(monkeypatch)
    be = vb.VLLMBackend("m", family="qwen3_vl", max_logprobs=64)
    assert be.factor == 32 and be.max_pixels == 16384 * 32 * 32
    tool_probability(be, [_conv("a")])
    assert be.llm.calls[-1][1].logprobs == JUDGE_LOGPROBS  # not the whole cap of 64
    be.next_token_probs([_conv("a")], ["yes"])
    assert be.llm.calls[-1][1].logprobs == 64
    with pytest.raises(ValueError, match="model family"):
        vb.VLLMBackend("m", family="llava")


# ---- engine settings and start-up failures -------------------------------------------------------


def test_engine_options_and_two_engines_sharing_one_device(monkeypatch, tiny_dirs):
    from dataclasses import replace

    from speceyes.cli import build_parser
    from speceyes.factory import BackendSettings, Settings, load_backends

    stand_in_vllm(monkeypatch)
    b = BackendSettings(engine="vllm", vllm_kv_cache_gib=1.5, vllm_max_model_len=4096,
                        vllm_eager=True)
    folders = {r: str(tiny_dirs[f]) for r, f in (("small", "qwen3_vl"), ("large", "qwen2_5_vl"))}
    s = Settings(small=folders["small"], large=folders["large"], backend=b)
    small, large = load_backends(s)
    for be in (small, large):
        kw = be.llm.kwargs
        assert kw["gpu_memory_utilization"] == 0.45  # both in one process: split by default
        assert kw["kv_cache_memory_bytes"] == int(1.5 * 2**30)
        assert kw["max_model_len"] == 4096 and kw["enforce_eager"] is True
    s.backend = replace(b, large_vllm_memory=0.6)  # one share given: the other takes the rest
    small, large = load_backends(s)
    assert large.llm.kwargs["gpu_memory_utilization"] == 0.6
    assert small.llm.kwargs["gpu_memory_utilization"] == pytest.approx(0.3)
    # One engine (one model named twice): vLLM's own default, nothing passed.
    alone, same = load_backends(Settings(small=folders["small"], large=folders["small"],
                                         backend=BackendSettings(engine="vllm")))
    assert alone is same and "gpu_memory_utilization" not in alone.llm.kwargs
    assert {"kv_cache_memory_bytes", "max_model_len", "enforce_eager"}.isdisjoint(alone.llm.kwargs)
    # The flags.
    ns = build_parser().parse_args(
        ["ask", "i.png", "q", "--small", "s", "--large", "l", "--engine", "vllm",
         "--small-vllm-memory", "0.2", "--large-vllm-memory", "0.7", "--vllm-kv-cache-gib", "2",
         "--vllm-max-model-len", "8192", "--vllm-eager"]
    )
    got = Settings.from_args(ns).backend
    assert (got.small_vllm_memory, got.large_vllm_memory) == (0.2, 0.7)
    assert (got.vllm_kv_cache_gib, got.vllm_max_model_len, got.vllm_eager) == (2.0, 8192, True)


GPU_SHORT = (
    "Free memory on device cuda:0 (30.1/79.2 GiB) on startup is less than desired GPU memory "
    "utilization (0.45, 35.6 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
    "other processes."
)


def test_memory_short_at_start_names_the_flag_to_change(monkeypatch, tiny_dirs, tmp_path, capsys):
    from speceyes.cli import main
    from speceyes.factory import BackendSettings, make_backend

    stand_in_vllm(monkeypatch)
    folder = str(tiny_dirs["qwen2_5_vl"])
    b = BackendSettings(engine="vllm")
    monkeypatch.setattr(LLM, "fail", ValueError(GPU_SHORT))
    with pytest.raises(vb.EngineStartError, match="--large-vllm-memory") as e:
        make_backend(folder, settings=b, role="large", shares_device=True)
    assert e.value.memory is True and "now 0.45" in str(e.value) and GPU_SHORT in str(e.value)
    # An engine-core process that failed leaves only a RuntimeError: the flags are named too.
    monkeypatch.setattr(LLM, "fail", RuntimeError("Engine core initialization failed. See root "
                                                  "cause above. Failed core proc(s): {}"))
    with pytest.raises(vb.EngineStartError, match="--small-vllm-memory") as e:
        make_backend(folder, settings=b, role="small")
    assert e.value.memory is None and "vLLM's default" in str(e.value)
    # Other errors are not taken for memory.
    monkeypatch.setattr(LLM, "fail", ValueError("Model architectures ['X'] are not supported"))
    with pytest.raises(ValueError, match="not supported"):
        make_backend(folder, settings=b)
    # From the command line: exit 2, the flag in the message.
    monkeypatch.setattr(LLM, "fail", ValueError(GPU_SHORT))
    image = tmp_path / "i.png"
    make_scene().save(image)
    argv = ["ask", str(image), "Color?", "--small", str(tiny_dirs["qwen3_vl"]), "--large", folder,
            "--engine", "vllm"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--small-vllm-memory" in err and "memory utilization" in err


def test_the_in_process_engine_takes_one_call_at_a_time():
    """vLLM's LLM steps its engine in the calling thread and collects every finished request:
    the pipelined schedule's two threads (front, agent loops) must not be in it together."""
    inside, most = [0], [0]

    class FakeLLM:
        def chat(self, convs, params, use_tqdm=False, **kw):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            inside[0] -= 1
            return [c[-1]["content"] for c in convs]

    be = object.__new__(vb.VLLMBackend)
    be.llm, be.factor, be.min_pixels, be.max_pixels = FakeLLM(), 28, 3136, 50176
    be._lock = threading.Lock()
    batch = [[{"role": "user", "content": "u"}]]
    threads = [threading.Thread(target=be._chat, args=(batch, None)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
