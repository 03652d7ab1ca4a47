"""``--protocol published`` runs the released SpecEyes code's methodology, not only its prompts:
phase IV one query at a time, Table 1's tau per backbone and benchmark, V* options in their
published order, and the small-model script's own prompt and batch size for the draft-only row.

Sources are github.com/MAC-AutoML/SpecEyes at 90d950f, cited by file and line.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from PIL import Image

from speceyes import prompts, protocols
from speceyes.agents.base import AgentOutcome, LoopAgent
from speceyes.bench.benchmarks import get as get_bench
from speceyes.cli import build_parser
from speceyes.factory import AgentSettings, Settings
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.images import load_image
from speceyes.protocols import FAIR, PUBLISHED
from speceyes.types import Query, SpecAnswer
from tests.conftest import make_scene


# ---- 1. phase IV schedule: eval_code_deepeyes/SpecEyes.py:687-692 ------------------------------
@dataclass
class _Loop:
    turns_left: int
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class _Recorder(LoopAgent):
    """Query "n" ends after n turns; records how many loops share each turn."""

    name = "deepeyes"  # a family the published protocol covers
    max_new_tokens = 1

    def __init__(self) -> None:
        self.turn_sizes: list[int] = []

    def start_loop(self, query: Query) -> _Loop:
        return _Loop(int(query.question))

    def _turn(self, active: list[_Loop]) -> None:
        self.turn_sizes.append(len(active))
        for lp in active:
            lp.turns_left -= 1
            if lp.turns_left <= 0:
                lp.outcome.answer, lp.done = "A", True


def _queries(turns: list[int]) -> list[Query]:
    img = make_scene(size=(64, 48))
    return [Query(id=str(i), image=img, question=str(n)) for i, n in enumerate(turns)]


def _agent_only(schedule: str | None, protocol: str = "fair") -> tuple[list, _Recorder]:
    agent = _Recorder()
    cfg = FunnelConfig(mode="agent", tau=0.5, batch_size=4, schedule=schedule, protocol=protocol)
    results = Funnel(None, object(), agent, cfg).run(_queries([2, 3, 1, 2, 1]))
    return results, agent


def test_serial_schedule_runs_one_agent_loop_at_a_time():
    serial, rec = _agent_only("serial")
    assert rec.turn_sizes == [1] * (2 + 3 + 1 + 2 + 1)  # every turn has one loop in it
    batched, rec_b = _agent_only("batched")
    assert max(rec_b.turn_sizes) == 4  # the batched schedule shares turns: the test can fail
    assert all(r.answer == "A" and r.error is None for r in serial)
    # Same answers, same input order; only the schedule (and so the time) differs.
    assert [(r.id, r.answer, r.route) for r in serial] == [
        (r.id, r.answer, r.route) for r in batched
    ]


def test_published_protocol_defaults_to_the_serial_schedule():
    assert PUBLISHED.schedule == "serial" and FAIR.schedule == "batched"
    # Unset (the CLI without --schedule): the protocol's, in the funnel and in Settings.
    _, rec = _agent_only(None, protocol="published")
    assert set(rec.turn_sizes) == {1}
    s = Settings(funnel=FunnelConfig(protocol="published", schedule=None, batch_size=None))
    assert s.resolved().funnel.schedule == "serial"
    fair = Settings(funnel=FunnelConfig(protocol="fair", schedule=None, batch_size=None))
    assert fair.resolved().funnel.schedule == "batched"


def _eval_args(*flags: str):
    argv = ["eval", "--bench", "vstar", "--data", "d", "--small", "s", "--large", "l"]
    return build_parser().parse_args([*argv, *flags])


def test_schedule_flag_still_overrides_the_protocol():
    args = _eval_args("--protocol", "published")
    assert Settings.from_args(args).resolved().funnel.schedule == "serial"
    args = _eval_args("--protocol", "published", "--schedule", "batched")
    assert Settings.from_args(args).resolved().funnel.schedule == "batched"
    args = _eval_args()
    assert Settings.from_args(args).resolved().funnel.schedule == "batched"


# ---- 2. tau per benchmark: parity audit row 20 (vis/vis_ablation_thres.py:121-217) -------------
@pytest.mark.parametrize(
    ("agent", "bench", "tau"),
    [
        ("deepeyes", "vstar", 0.98),
        ("deepeyes", "hrbench", 0.97),
        ("deepeyes", "pope", 0.97),
        ("thyme", "vstar", 0.98),
        ("thyme", "hrbench", 0.98),
        ("thyme", "pope", 0.97),
    ],
)
def test_published_tau_is_table_1s_per_backbone_and_benchmark(agent, bench, tau):
    s = Settings(agent=AgentSettings(kind=agent), funnel=FunnelConfig(protocol="published"))
    s.bench = bench
    assert s.resolved().funnel.tau == tau
    # The fair protocol keeps the agent's own threshold; a given tau always wins.
    agent_tau = AgentSettings(kind=agent).agent_class().default_tau
    fair = Settings(agent=AgentSettings(kind=agent), bench=bench)
    assert fair.resolved().funnel.tau == agent_tau
    given = Settings(
        agent=AgentSettings(kind=agent), funnel=FunnelConfig(protocol="published", tau=0.5)
    )
    given.bench = bench
    assert given.resolved().funnel.tau == 0.5


def test_published_tau_without_a_published_benchmark_is_the_agents():
    for bench in (None, "jsonl"):
        s = Settings(
            agent=AgentSettings(kind="thyme"),
            funnel=FunnelConfig(protocol="published"),
            bench=bench,
        )
        assert s.resolved().funnel.tau == AgentSettings(kind="thyme").agent_class().default_tau


def test_eval_passes_the_benchmark_name_to_the_settings(tmp_path, monkeypatch):
    import json

    import speceyes.factory as factory
    from speceyes.cli import main

    for category in ("direct_attributes", "relative_position"):
        folder = tmp_path / category
        folder.mkdir()
        make_scene(size=(64, 48)).save(folder / "sa_1.jpg")
        ann = {"question": "What color?", "options": ["red", "blue"]}
        (folder / "sa_1.json").write_text(json.dumps(ann))
    seen: list[Settings] = []

    class _Stop(Exception):
        pass

    def fake_build(settings, *a, **kw):
        seen.append(settings)
        raise _Stop

    monkeypatch.setattr(factory, "build_funnel", fake_build)
    argv = ["eval", "--bench", "v*", "--data", str(tmp_path), "--small", "s", "--large", "l"]
    with pytest.raises(_Stop):
        main([*argv, "--protocol", "published", "--agent", "thyme"])
    assert seen[0].bench == "vstar"  # the registry's name, not the alias given
    assert seen[0].resolved().funnel.tau == protocols.PUBLISHED_TAU[("thyme", "vstar")]


# ---- 3. V* options unshuffled: eval_code_deepeyes/SpecEyes.py:52-75 (options as listed) --------
@pytest.mark.parametrize(
    ("flags", "shuffled"),
    [
        ((), True),
        (("--no-shuffle",), False),
        (("--protocol", "published"), False),
        (("--protocol", "published", "--shuffle"), True),
        (("--protocol", "fair", "--shuffle"), True),
    ],
)
def test_published_keeps_the_vstar_option_order_unless_asked(flags, shuffled):
    args = _eval_args(*flags)
    assert get_bench("vstar").loader_kw_from_args(args)["shuffle"] is shuffled


def test_shuffle_and_no_shuffle_exclude_each_other():
    with pytest.raises(SystemExit):
        _eval_args("--shuffle", "--no-shuffle")


# ---- 4. draft-only row: scripts/small_model_batch_inference.py:379-387 and :407 ----------------
def test_draft_block_is_the_small_model_scripts():
    # :383-385 build option_str as "\n" + each "A. x" line + "\n", then "Options: {option_str}"
    # with no indentation; :387 POPE (no options) "Question: {q}\n".
    assert protocols.published_draft_block("Is it red?", ["red", "blue"]) == (
        "Question: Is it red?\nOptions: \nA. red\nB. blue\n"
    )
    assert protocols.published_draft_block("Is there a cat?", None) == "Question: Is there a cat?\n"
    # The SpecEyes.py block keeps its 8-space indentation; the script's does not.
    assert protocols.published_question_block("q", ["x"]) != protocols.published_draft_block(
        "q", ["x"]
    )


class _Small:
    """A small model that records the conversations it is asked to answer."""

    scores = "topk"
    max_logprobs = None

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    def answer(self, batch, *, max_new_tokens, top_k):
        self.seen.extend(batch)
        row = -np.arange(top_k, dtype=np.float32)[None, :]
        return [SpecAnswer("A", row) for _ in batch]


def test_small_only_mode_sends_the_scripts_prompt():
    small = _Small()
    img = make_scene(size=(64, 48))
    queries = [
        Query(id="mc", image=img, question="Which?", options=["x", "y"]),
        Query(id="yn", image=img, question="Is there a box?"),
    ]
    cfg = FunnelConfig(mode="small", tau=0.5, batch_size=8, protocol="published")
    Funnel(small, None, None, cfg).run(queries)
    texts = [m[1]["content"][-1]["text"] for m in small.seen]
    # :148-156 prepare_messages_to_answer: SYSTEM_PROMPT_ANSWER and question + "\nAnswer:".
    assert texts == [
        "Question: Which?\nOptions: \nA. x\nB. y\n" + prompts.SMALL_SUFFIX,
        "Question: Is there a box?\n" + prompts.SMALL_SUFFIX,
    ]
    assert all(m[0]["content"] == prompts.SMALL_SYSTEM for m in small.seen)


def test_small_only_mode_batches_eight_under_published():
    for agent in protocols.PUBLISHED_AGENTS:
        small = Settings(
            agent=AgentSettings(kind=agent),
            funnel=FunnelConfig(mode="small", protocol="published", batch_size=None),
        )
        assert small.resolved().funnel.batch_size == protocols.PUBLISHED_DRAFT_BATCH_SIZE == 8
        full = Settings(
            agent=AgentSettings(kind=agent),
            funnel=FunnelConfig(protocol="published", batch_size=None),
        )
        assert full.resolved().funnel.batch_size == protocols.PUBLISHED_BATCH_SIZE == 6


# ---- 5. images as the scripts read them --------------------------------------------------------
# eval_code_deepeyes/SpecEyes.py:176 and :126, eval_code_thyme/SpecEyes.py:87 (Image.open),
# scripts/fetch_image.py:67-70 (qwen-vl-utils fetch_image: Image.open, to_rgb): nothing applies
# the EXIF orientation.
def _jpeg(img: Image.Image, orientation: int | None = None, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    img.save(buf, format="JPEG", quality=quality, exif=exif.tobytes())
    return buf.getvalue()


def _noise(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode)
    return Image.fromarray(rng.integers(0, 256, (h, w, bands), dtype=np.uint8), mode)


def _q(image, **kw) -> Query:
    return Query(id="q", image=image, question="Which?", **kw)


def test_published_images_are_never_exif_rotated():
    data = _jpeg(_noise(60, 40), orientation=6)  # stored 60x40, "rotate 90" in EXIF
    vstar = _q(data, options=["x", "y"], category="direct_attributes")
    assert load_image(data).size == (40, 60)  # fair: upright
    assert FAIR.open_image(vstar, "deepeyes").size == (40, 60)
    raw = PUBLISHED.open_image(vstar, "deepeyes")
    assert raw.size == (60, 40)
    assert load_image(raw, copy=False).size == (60, 40)  # nothing downstream rotates it
    shown, view = protocols.published_view(data)
    assert (view.orig_w, view.orig_h) == (60, 40)
    assert shown.size == protocols.published_smart_resize(60, 40)
    # The DeepEyes loop shows and crops the stored pixels too (SpecEyes.py:196, :255).
    from speceyes.agents.published_zoom import PublishedZoomAgent
    from tests.test_protocols import Scripted

    be = Scripted(["<answer>A</answer>"])
    PublishedZoomAgent(be).run([vstar])
    assert be.seen[0][0][1]["content"][0]["image"].size == protocols.published_smart_resize(60, 40)


def test_thyme_reencodes_hrbench_and_pope_as_jpeg_95():
    # eval_code_thyme/SpecEyes.py:71-79 (HR-Bench) and :679-684 (POPE): decoded, saved as
    # JPEG quality 95, and that file is what every later step reads. V* is read where it is.
    src = _noise(96, 64, seed=1)
    png = io.BytesIO()
    src.save(png, format="PNG")
    buf = io.BytesIO()
    src.save(buf, format="JPEG", quality=95)
    want = np.asarray(Image.open(buf).convert("RGB"))
    pope = _q(png.getvalue(), category="adversarial")
    hr = _q(png.getvalue(), options=list("abcd"), meta={"index": "0", "cycle_category": "x"})
    vstar = _q(png.getvalue(), options=["x", "y"], category="direct_attributes")
    for query in (pope, hr):
        assert protocols.reencodes_jpeg("thyme", query)
        got = PUBLISHED.open_image(query, "thyme")
        assert np.array_equal(np.asarray(got), want)
        assert not np.array_equal(np.asarray(got), np.asarray(src))  # the test can fail
        assert np.array_equal(np.asarray(protocols.published_image(got, jpeg=True)), want)  # once
        assert np.array_equal(np.asarray(PUBLISHED.open_image(query, "deepeyes")), np.asarray(src))
    assert not protocols.reencodes_jpeg("thyme", vstar)
    assert np.array_equal(np.asarray(PUBLISHED.open_image(vstar, "thyme")), np.asarray(src))


def test_published_rgb_conversion_is_qwen_vl_utils():
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))  # fully transparent
    png = io.BytesIO()
    rgba.save(png, format="PNG")
    # qwen-vl-utils 0.0.14 to_rgb: RGBA on white
    assert protocols.published_image(png.getvalue()).getpixel((0, 0)) == (255, 255, 255)
    # Thyme's JPEG step converts RGBA to RGB first (SpecEyes.py:75-76): the alpha is dropped
    jpeg = protocols.published_image(png.getvalue(), jpeg=True).getpixel((0, 0))
    assert max(abs(a - b) for a, b in zip(jpeg, (10, 20, 30), strict=True)) <= 3


# ---- 6. the small model's reply ---------------------------------------------------------------
class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


class _Replies:
    """A small model whose replies are given; its text is stripped like the real backends'."""

    scores = "topk"
    max_logprobs = None
    tokenizer = _CharTokenizer()

    def __init__(self, replies: list[str], name: str = "Qwen3-VL-2B-Instruct") -> None:
        self.replies, self.name, self.budgets = replies, name, []

    def answer(self, batch, *, max_new_tokens, top_k):
        self.budgets.append(max_new_tokens)
        row = -np.arange(top_k, dtype=np.float32)[None, :]
        return [SpecAnswer(r.strip(), row, token_ids=[ord(c) for c in r]) for r in self.replies]


def test_published_prediction_is_the_unstripped_reply():
    # eval_code_deepeyes/SpecEyes.py:635-638 (and :696-699, eval_code_thyme/SpecEyes.py:430-433):
    # the <answer> span when both tags are there, else the decoded reply as it is.
    replies = [" A", "<answer> B </answer>", "<think>x</think>\n\nC", "A\n"]
    kw = {"max_new_tokens": 20, "top_k": 4, "agg": "min"}
    pub = [a.text for a in PUBLISHED.answers(_Replies(replies), [[]] * 4, **kw)]
    assert pub == [" A", "B", "<think>x</think>\n\nC", "A\n"]  # nothing is cut after </think>
    fair = [a.text for a in FAIR.answers(_Replies(replies), [[]] * 4, **kw)]
    assert fair == [r.strip() for r in replies]
    # The bytes matter to the judge scripts: judge_vstar.py:140 takes a 1-character answer only.
    from speceyes.bench.published_scoring import VSTAR_SCRIPT

    rec = {"answer": "A", "options": ["red", "blue"]}
    assert VSTAR_SCRIPT.rule({**rec, "prediction": "A"})[0] is True
    assert VSTAR_SCRIPT.rule({**rec, "prediction": " A"})[0] is None  # to the LLM judge


@pytest.mark.parametrize(
    ("name", "family", "budget"),
    [
        ("Qwen3-VL-2B-Thinking", "deepeyes", 1024),  # eval_code_deepeyes/SpecEyes.py:351-352
        ("Qwen3-VL-2B-Thinking", "thyme", 20),  # eval_code_thyme/SpecEyes.py:175-181: none
        ("Qwen3-VL-2B-Thinking", None, 20),
        ("Qwen3-VL-2B-Instruct", "deepeyes", 20),
    ],
)
def test_thinking_small_model_budget(name, family, budget):
    be = _Replies(["A"], name=name)
    PUBLISHED.answers(be, [[]], max_new_tokens=20, top_k=4, agg="min", family=family)
    assert be.budgets == [budget]
    fair = _Replies(["A"], name=name)
    FAIR.answers(fair, [[]], max_new_tokens=20, top_k=4, agg="min", family=family)
    assert fair.budgets == [20]


# ---- 7. the image path Thyme's prompt names ----------------------------------------------------
def test_thyme_image_paths_are_the_scripts():
    from speceyes.agents.published_code import published_image_path

    small, wide = Image.new("RGB", (3840, 2160)), Image.new("RGB", (7680, 4320))
    vstar = _q("/any/where/direct_attributes/sa_17.jpg", options=["x", "y"],
               category="direct_attributes")  # fmt: skip
    assert published_image_path(vstar, small) == "data/vstar/direct_attributes/sa_17.jpg"  # :587
    pope = _q(b"", category="popular", meta={"question_id": "12"})
    assert published_image_path(pope, small) == "./eval_code_thyme/_tmp_pope_images/popular/00000011.jpg"
    pope.meta["row"] = 3  # a loader's row position wins
    assert published_image_path(pope, small).endswith("/popular/00000003.jpg")
    hr = _q(b"", options=list("abcd"), meta={"index": "5", "cycle_category": "c"})
    assert published_image_path(hr, small) == "./eval_code_thyme/_tmp_hr_images/hr_bench_4k/00000005.jpg"
    assert "/hr_bench_8k/00000005.jpg" in published_image_path(hr, wide)
    hr.meta["split"] = "hr_bench_4k"
    assert "/hr_bench_4k/" in published_image_path(hr, wide)


def test_the_funnel_opens_images_and_budgets_answers_through_the_protocol():
    """Phases I-II see what the published loops see: the stored (never EXIF-rotated) pixels,
    and a Thinking small model gets the DeepEyes script's budget (SpecEyes.py:351-352)."""
    data = _jpeg(_noise(60, 40), orientation=6)
    query = _q(data, options=["x", "y"], category="direct_attributes")

    class _Thinking(_Small):
        name = "Qwen3-VL-2B-Thinking"

        def __init__(self) -> None:
            super().__init__()
            self.budgets: list[int] = []

        def answer(self, batch, *, max_new_tokens, top_k):
            self.budgets.append(max_new_tokens)
            return super().answer(batch, max_new_tokens=max_new_tokens, top_k=top_k)

    from speceyes.agents.published_zoom import PublishedZoomAgent

    seen = {}
    for protocol in ("fair", "published"):
        small = _Thinking()
        agent = PublishedZoomAgent(_Small()) if protocol == "published" else None
        cfg = FunnelConfig(mode="small", tau=0.5, protocol=protocol, max_new_tokens=20)
        Funnel(small, None, agent, cfg).run([query])
        image = next(p["image"] for p in small.seen[0][1]["content"] if p.get("type") == "image")
        w, h = load_image(image, copy=False).size
        seen[protocol] = ("landscape" if w > h else "portrait", small.budgets)
    assert seen["fair"] == ("portrait", [20])  # upright; the asked budget
    assert seen["published"] == ("landscape", [1024])  # stored pixels; the Thinking budget
