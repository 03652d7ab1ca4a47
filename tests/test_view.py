"""`speceyes view` on real runs of tiny models, bad input, and the page in a real headless browser.

The browser is Debian's chromium, installed by the session fixture below when it is missing (once
per machine); the browser tests skip with the reason only where it cannot be installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from speceyes.cli import main
from speceyes.view import ViewError, build_view, write_view
from tests.conftest import make_scene
from tests.tools.synthetic_run import write_synthetic_run

N_PER_CAT = 2
CHUNK = 60  # cards the page renders before the reader scrolls (viewer.js)


def _vstar(root: Path) -> Path:
    colors = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for cat in ("direct_attributes", "relative_position"):
        (root / cat).mkdir(parents=True)
        for i in range(N_PER_CAT):
            name = list(colors)[i % 2]
            box = (30 + 20 * i, 40, 120 + 20 * i, 130)
            make_scene(box=box, color=colors[name]).save(root / cat / f"img{i}.jpg")
            meta = {
                "question": "What color is the square?",
                "options": [name, *[c for c in colors if c != name]],
                "target_object": "square",
                "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]],
            }
            (root / cat / f"img{i}.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def runs(tiny_dirs, tmp_path_factory):
    """Two real runs of the same V*-layout benchmark: SpecEyes with everything logged, agent only.

    The search agent zooms without tool-call training, so random tiny models still leave boxes."""
    root = tmp_path_factory.mktemp("view-runs")
    data = _vstar(root / "vstar")
    out = {}
    for mode in ("both", "agent"):
        out[mode] = root / mode
        args = ["eval", "--bench", "vstar", "--data", str(data), "--output", str(out[mode])]
        args += ["--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"])]
        args += ["--mode", mode, "--tau", "0.5", "--batch-size", "2", "--agent", "search"]
        args += ["--agent-max-tokens", "8", "--no-progress"]
        assert main(args) == 0
    return {"data": data, **out}


def _doc(index: Path) -> dict:
    text = index.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="speceyes-data">(.*?)</script>', text, re.S)
    assert m, "the page embeds its data"
    return json.loads(m.group(1))


def _samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def test_view_of_real_runs(runs, tmp_path):
    out = tmp_path / "view"
    res = build_view([runs["both"], runs["agent"]], out)
    assert res.index == out / "index.html" and res.notes == []
    assert res.cards == 4 * N_PER_CAT and res.images_made == 2 * N_PER_CAT  # one image per query
    doc = _doc(res.index)
    assert [r["name"] for r in doc["runs"]] == ["both", "agent"]
    samples = _samples(runs["both"])
    cards = {c["id"]: c for c in doc["runs"][0]["cards"]}
    assert set(cards) == {s["id"] for s in samples}
    for s in samples:
        c = cards[s["id"]]
        zooms = [t["crop_box"] for t in s["trace"] if t["type"] == "zoom"]
        assert zooms, "the search agent zoomed"
        assert c["b"] == zooms and c["r"] == s["route"] and c["tk"] == len(s["small_topk"])
        assert c["cf"] == pytest.approx(s["confidence"]) and c["sa"] == s["small_answer"]
        assert c["ok"] == s["correct"] and c["g"] == s["answer"] and c["o"] == s["options"]
        img = doc["images"][c["im"]]
        assert (img["w"], img["h"]) == (400, 300)  # original pixels: the boxes' frame
        thumb = Image.open(out / "img" / f"{c['im']}_t.jpg")
        assert max(thumb.size) == 320 and (out / "img" / f"{c['im']}_f.jpg").is_file()
        x, y, w, h = s["meta"]["bbox"]
        assert c["gb"] == [[x, y, x + w, y + h]]
    # Both runs show the same query with the same image.
    assert {c["im"] for c in doc["runs"][1]["cards"]} == {c["im"] for c in cards.values()}
    page = res.index.read_text()
    for plot in ("confidence_kde.png", "pareto.png", "acceptance.png"):
        assert (out / "runs" / "0" / "plots" / plot).is_file() and plot in page
    assert "http://" not in page and "https://" not in page  # nothing from the network
    # A second build reuses every image.
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "img").glob("*.jpg")}
    again = build_view([runs["both"], runs["agent"]], out)
    assert (again.images_made, again.images_reused) == (0, 2 * N_PER_CAT)
    assert {p: p.stat().st_mtime_ns for p in (out / "img").glob("*.jpg")} == mtimes


def test_bad_input_still_builds(runs, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(runs["both"], run)
    (run / "results.json").unlink()  # a run still being written has none yet
    lines = (run / "samples.jsonl").read_text().splitlines(keepends=True)
    lines.insert(1, "{not json\n")
    (run / "samples.jsonl").write_text("".join(lines[:-1]) + lines[-1][:50])  # torn last line
    moved = tmp_path / "moved-vstar"
    shutil.copytree(runs["data"], moved)
    raw = json.loads((run / "run.json").read_text())
    raw["config"]["data"] = str(tmp_path / "gone")
    (run / "run.json").write_text(json.dumps(raw))
    missing = tmp_path / "empty"
    missing.mkdir()

    res = build_view([run, missing], tmp_path / "view")
    text = "\n".join(res.notes)
    assert "results.json is missing: the run is still being written" in text
    assert "last line is cut off" in text and "1 corrupt line(s) skipped (line 2)" in text
    assert "samples.jsonl is missing" in text
    assert "cannot read the benchmark's images" in text and "--data" in text
    doc = _doc(res.index)
    cards = doc["runs"][0]["cards"]
    assert len(cards) == 2 * N_PER_CAT - 1 and doc["runs"][1]["cards"] == []
    assert all("err" in doc["images"][c["im"]] for c in cards)
    assert all(n in res.index.read_text() for n in ("cut off", "corrupt line"))  # on the page

    # --data points at the benchmark's new place: the images are back.
    fixed = build_view([run], tmp_path / "view", data=moved)
    assert fixed.images_made == len(cards)
    assert all("w" in img for img in _doc(fixed.index)["images"].values())


def test_images_of_a_jsonl_benchmark(tmp_path):
    """A generic JSONL benchmark (the mini world's format): relative image paths, loader
    settings the JSONL loader does not take (the demo logs its split), a query not in it."""
    bench = tmp_path / "bench"
    (bench / "pics").mkdir(parents=True)
    rows = []
    for i in range(3):
        make_scene(size=(200 + 10 * i, 100)).save(bench / "pics" / f"{i}.png")
        rows.append({"id": f"q{i:06d}", "image": f"pics/{i}.png", "question": "Is it red?"})
    (bench / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = write_synthetic_run(tmp_path / "run", n=4, mode="speceyes")
    res = json.loads((run / "results.json").read_text())
    res["config"] |= {"bench": "jsonl", "data": str(bench / "q.jsonl")}
    res["config"]["loader"] = {"target_size": "small", "split": "test"}
    (run / "results.json").write_text(json.dumps(res))
    view = build_view([run], tmp_path / "view")
    assert view.images_made == 3
    assert view.notes == ["run: 1 logged query id(s) not in the benchmark (q000003)"]
    doc = _doc(view.index)
    sizes = [doc["images"][c["im"]] for c in doc["runs"][0]["cards"]]
    assert [(s.get("w"), s.get("h")) for s in sizes] == [
        (200, 100),
        (210, 100),
        (220, 100),
        (None, None),
    ]


def test_cli_view_and_clear_errors(runs, tmp_path, capsys):
    out = tmp_path / "v"
    assert main(["view", str(runs["both"]), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str((out / "index.html").resolve())
    assert write_view([runs["both"]], out) == out / "index.html"
    assert main(["view", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "run folder not found" in capsys.readouterr().err
    with pytest.raises(ViewError, match="not a folder"):
        build_view([runs["both"]], runs["both"] / "results.json")


# ------------------------------------------------------------------------------ 10,000 queries


def _big_run(root: Path, n: int) -> Path:
    """A synthetic 10,000-query run with images, zooms and a few errors (images shared, as
    several questions ask about one picture)."""
    run = write_synthetic_run(root / "big", n=n, seed=1, mode="speceyes", tau=0.9)
    pics = []
    for i in range(20):
        p = root / f"pic{i}.png"
        make_scene(size=(640, 480), box=(20 * i, 30, 20 * i + 80, 110)).save(p)
        pics.append(str(p))
    lines = []
    for i, s in enumerate(_samples(run)):
        s |= {"image": pics[i % len(pics)], "question": f"What is in picture {i}?"}
        if s["agent_answer"] is not None:
            s["trace"] = [{"type": "zoom", "crop_box": [10, 10, 200 + i % 50, 150]}]
        if i % 97 == 0:
            s |= {"route": "error", "error": "timeout", "correct": False}
        lines.append(json.dumps(s) + "\n")
    (run / "samples.jsonl").write_text("".join(lines))
    return run


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("view-big")
    run = _big_run(root, 10_000)
    t0 = time.perf_counter()
    res = build_view([run], root / "view")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_view([run], root / "view")
    again = time.perf_counter() - t0
    print(f"\nview of 10,000 queries: first build {first:.2f} s, rebuild {again:.2f} s")
    return {"run": run, "index": res.index, "samples": _samples(run), "result": res}


@pytest.mark.slow
def test_ten_thousand_queries_build(big):
    res = big["result"]
    assert res.cards == 10_000 and res.images_made == 20
    assert len(_doc(big["index"])["runs"][0]["cards"]) == 10_000


# ------------------------------------------------------------------------------ the browser


def _find_browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def _install_chromium() -> str:
    """Install Debian's chromium; returns why it failed ("" when it worked)."""
    if shutil.which("apt-get") is None:
        return "this system has no apt-get"
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"] if shutil.which("sudo") else None
    if prefix is None:
        return "not root and no sudo to run apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
    ):
        r = subprocess.run(prefix + cmd, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode:
            return f"`{' '.join(cmd)}` failed: {r.stderr.strip()[-300:]}"
    return ""


@pytest.fixture(scope="session")
def browser():
    exe = _find_browser()
    why = "" if exe else _install_chromium()
    exe = exe or _find_browser()
    if exe is None:
        msg = f"no headless browser: Debian's chromium could not be installed ({why})"
        if os.environ.get("CI"):  # CI installs it: a missing browser there is a failure
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return exe


def _chromium(exe: str, tmp: Path, url: str, *args: str) -> str:
    profile = tmp / f"profile-{time.monotonic_ns()}"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    cmd += [f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _dom(exe: str, tmp: Path, index: Path, view: str = "") -> dict:
    dom = _chromium(exe, tmp, index.resolve().as_uri() + (f"#{view}" if view else ""), "--dump-dom")
    status = re.search(r'id="status" data-matching="(\d+)" data-shown="(\d+)"', dom)
    assert status, "the script ran and rendered the status line"
    dom = dom[dom.index('<main id="cards">') : dom.index("</main>")]  # not the script's own text
    return {
        "matching": int(status.group(1)),
        "shown": int(status.group(2)),
        "ids": re.findall(r'<article class="card[^"]*" data-id="([^"]*)"', dom),
        "boxes_a": len(re.findall(r'<rect class="box a"', dom)),
        "boxes_b": len(re.findall(r'<rect class="box b"', dom)),
        "gold": len(re.findall(r'<rect class="gold"', dom)),
        "differs": len(re.findall(r'<article class="card[^"]* differs"', dom)),
        "dom": dom,
    }


@pytest.mark.slow
def test_page_in_a_real_browser(browser, runs, tmp_path):
    index = write_view([runs["both"], runs["agent"]], tmp_path / "view")
    both, agent = _samples(runs["both"]), _samples(runs["agent"])
    n = len(both)
    zooms = sum(1 for s in both for t in s["trace"] if t["type"] == "zoom")
    page = _dom(browser, tmp_path, index)
    assert page["matching"] == page["shown"] == len(page["ids"]) == n
    assert page["boxes_a"] == zooms and page["gold"] == n
    # The agent-only run shares every query: it is compared by default, its boxes drawn too.
    assert page["boxes_b"] == sum(1 for s in agent for t in s["trace"] if t["type"] == "zoom")
    differ = sum(
        1
        for a, b in zip(both, agent, strict=True)
        if a["prediction"].strip().lower() != b["prediction"].strip().lower()
        or a["correct"] != b["correct"]
    )
    assert page["differs"] == differ
    for view, expected in (
        ("verdict=right", sum(s["correct"] for s in both)),
        ("verdict=wrong", sum(not s["correct"] for s in both)),
        (f"route={both[0]['route']}", sum(s["route"] == both[0]["route"] for s in both)),
        ("cat=relative_position", N_PER_CAT),
        ("diff=differ", differ),
    ):
        got = _dom(browser, tmp_path, index, view)
        assert got["matching"] == len(got["ids"]) == expected, view
    alone = _dom(browser, tmp_path, index, "cmp=-1")
    assert alone["boxes_b"] == 0 and alone["differs"] == 0

    shot = tmp_path / "shot.png"
    _chromium(browser, tmp_path, index.resolve().as_uri(), f"--screenshot={shot}",
              "--window-size=1280,1000")  # fmt: skip
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 1000)
    assert max(ImageStat.Stat(img).stddev) > 20, "the screenshot is blank"
    assert len(img.resize((320, 250)).getcolors(1 << 17)) > 100, "the screenshot is blank"


@pytest.mark.slow
def test_ten_thousand_queries_in_the_browser(browser, big, tmp_path):
    samples, index = big["samples"], big["index"]
    page = _dom(browser, tmp_path, index)
    # Rendered lazily: all 10,000 match, the first chunk is in the page.
    assert page["matching"] == 10_000 and page["shown"] == len(page["ids"]) == CHUNK
    assert page["ids"] == [s["id"] for s in samples[:CHUNK]]
    assert page["boxes_a"] == sum(1 for s in samples[:CHUNK] if "trace" in s and s["trace"])
    errors = sum(1 for s in samples if s.get("error"))
    for view, expected in (
        ("route=small", sum(s["route"] == "small" for s in samples)),
        ("err=yes", errors),
        ("cat=relative_position&verdict=wrong", sum(
            s["category"] == "relative_position" and not (s["correct"] and not s.get("error"))
            for s in samples
        )),
        ("q=q000123", 1),
    ):  # fmt: skip
        assert _dom(browser, tmp_path, index, view)["matching"] == expected, view
    confident = _dom(browser, tmp_path, index, "sort=conf-desc")["ids"]
    by_conf = sorted(
        (s for s in samples if s["confidence"] is not None), key=lambda s: -s["confidence"]
    )
    assert confident[:5] == [s["id"] for s in by_conf[:5]]
    slow = _dom(browser, tmp_path, index, "sort=time-desc")["ids"][0]
    assert slow == max(samples, key=lambda s: sum(s["timings"].values()))["id"]
