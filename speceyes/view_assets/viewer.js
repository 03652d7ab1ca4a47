// speceyes view: renders the cards of the embedded JSON in chunks as the reader scrolls.
// State (run, comparison, filters, sort, search) lives in the URL hash, so views can be linked.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("speceyes-data").textContent);
  const CHUNK = 60;
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const fmt = (x, d) => (x === undefined || x === null ? "–" : Number(x).toFixed(d));
  const norm = (s) => String(s === undefined || s === null ? "" : s).trim().toLowerCase();
  const hasErr = (c) => Boolean(c.e || c.ae || c.itc);
  const KEYS = ["run", "cmp", "route", "verdict", "cat", "err", "diff", "q", "sort"];
  const S = { run: 0, cmp: -1, route: "", verdict: "", cat: "", err: "", diff: "", q: "", sort: "file" };
  const byId = D.runs.map((r) => new Map(r.cards.map((c) => [c.id, c])));
  let list = [];
  let shown = 0;

  function shared(i, j) {
    let n = 0;
    for (const id of byId[i].keys()) if (byId[j].has(id)) n++;
    return n;
  }

  function readHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    for (const k of KEYS) if (h.has(k)) S[k] = ["run", "cmp"].includes(k) ? Number(h.get(k)) : h.get(k);
    if (!(S.run >= 0 && S.run < D.runs.length)) S.run = 0;
    if (!h.has("cmp")) { // default: the first other run that shares queries with this one
      S.cmp = -1;
      for (let j = 0; j < D.runs.length; j++) if (j !== S.run && shared(S.run, j)) { S.cmp = j; break; }
    }
    if (!(S.cmp >= 0 && S.cmp < D.runs.length) || S.cmp === S.run) S.cmp = -1;
  }

  function writeHash() {
    const h = new URLSearchParams();
    for (const k of KEYS) h.set(k, S[k]);
    history.replaceState(null, "", "#" + h.toString());
  }

  function select(key, label, options) {
    const opts = options.map(([v, t]) =>
      `<option value="${esc(v)}"${String(S[key]) === String(v) ? " selected" : ""}>${esc(t)}</option>`);
    return `<label>${esc(label)} <select id="f-${key}" data-key="${key}">${opts.join("")}</select></label>`;
  }

  function controls() {
    const cards = D.runs[S.run].cards;
    const routes = [...new Set(cards.map((c) => c.r))].sort();
    const cats = [...new Set(cards.map((c) => c.c).filter((c) => c !== undefined))].sort();
    const runs = D.runs.map((r, i) => [i, r.name + " (" + r.mode + ")"]);
    const others = [[-1, "none"]].concat(runs.filter(([i]) => i !== S.run)
      .map(([i, t]) => [i, t + ": " + shared(S.run, i) + " shared"]));
    let h = select("run", "run", runs) + select("cmp", "compare with", others);
    h += select("route", "route", [["", "all"]].concat(routes.map((r) => [r, r || "(none)"])));
    h += select("verdict", "answer", [["", "all"], ["right", "right"], ["wrong", "wrong"]]);
    if (cats.length) h += select("cat", "category", [["", "all"]].concat(cats.map((c) => [c, c])));
    h += select("err", "errors", [["", "all"], ["yes", "with errors"], ["no", "without"]]);
    if (S.cmp >= 0) {
      h += select("diff", "vs compared", [["", "all"], ["differ", "answers differ"],
        ["a", "only this run right"], ["b", "only compared right"]]);
    }
    h += select("sort", "sort", [["file", "log order"], ["conf-desc", "confidence ↓"],
      ["conf-asc", "confidence ↑"], ["time-desc", "time ↓"], ["time-asc", "time ↑"],
      ["ptool-desc", "P(tool) ↓"]]);
    h += `<label>search <input type="search" id="f-q" value="${esc(S.q)}" placeholder="id, question, answer"></label>`;
    $("controls").innerHTML = h;
    for (const el of $("controls").querySelectorAll("select")) {
      el.addEventListener("change", () => {
        const k = el.dataset.key;
        S[k] = ["run", "cmp"].includes(k) ? Number(el.value) : el.value;
        if (k === "run") { S.route = ""; S.cat = ""; if (S.cmp === S.run) S.cmp = -1; }
        if (k === "run" || k === "cmp") { S.diff = ""; controls(); }
        update();
      });
    }
    let timer = 0;
    $("f-q").addEventListener("input", (ev) => {
      clearTimeout(timer);
      timer = setTimeout(() => { S.q = ev.target.value; update(); }, 150);
    });
  }

  function differs(a, b) {
    if (!b) return false;
    return norm(a.p) !== norm(b.p) || a.ok !== b.ok;
  }

  function keep(c) {
    if (S.route && c.r !== S.route) return false;
    if (S.verdict && c.ok !== (S.verdict === "right")) return false;
    if (S.cat && c.c !== S.cat) return false;
    if (S.err && hasErr(c) !== (S.err === "yes")) return false;
    if (S.cmp >= 0 && S.diff) {
      const b = byId[S.cmp].get(c.id);
      if (!b) return false;
      if (S.diff === "differ" && !differs(c, b)) return false;
      if (S.diff === "a" && !(c.ok && !b.ok)) return false;
      if (S.diff === "b" && !(!c.ok && b.ok)) return false;
    }
    if (S.q) {
      const q = norm(S.q);
      const b = S.cmp >= 0 ? byId[S.cmp].get(c.id) : null;
      const text = [c.id, c.q, c.c, c.g, c.p, c.sa, c.aa, (c.o || []).join(" "), b ? b.p : ""]
        .map(norm).join("\n");
      if (!text.includes(q)) return false;
    }
    return true;
  }

  function sorted(cards) {
    if (S.sort === "file") return cards;
    const [key, dir] = S.sort.split("-");
    const field = { conf: "cf", time: "tt", ptool: "pt" }[key];
    const sign = dir === "asc" ? 1 : -1;
    const val = (c) => (c[field] === undefined || c[field] === null ? null : c[field]);
    return cards.slice().sort((x, y) => {
      const a = val(x); const b = val(y);
      if (a === null || b === null) return (a === null) - (b === null); // unknown values last
      return sign * (a - b);
    });
  }

  function boxesSvg(c, img, b) {
    let s = `<svg viewBox="0 0 ${img.w} ${img.h}" preserveAspectRatio="none">`;
    for (const g of c.gb || []) {
      s += `<rect class="gold" x="${g[0]}" y="${g[1]}" width="${g[2] - g[0]}" height="${g[3] - g[1]}"></rect>`;
    }
    const draw = (card, cls) => (card && card.b || []).map((x, i) =>
      `<rect class="box ${cls}" data-step="${i + 1}" x="${x[0]}" y="${x[1]}" width="${x[2] - x[0]}"` +
      ` height="${x[3] - x[1]}"><title>${cls === "a" ? "this run" : "compared run"}: zoom ${i + 1}</title></rect>`).join("");
    return s + draw(c, "a") + draw(b, "b") + "</svg>";
  }

  function figure(c, b) {
    const img = c.im ? D.images[c.im] : null;
    if (!img || img.err || !img.w) {
      return `<div class="fig noimg">${esc(img && img.err ? img.err : "no image")}</div>`;
    }
    const nums = (card, cls) => (card && card.b || []).map((_, i) => `<span class="boxnum ${cls}">${i + 1}</span>`).join("");
    return `<div class="fig" style="aspect-ratio:${img.w}/${img.h}" data-img="${esc(c.im)}">` +
      `<img loading="lazy" src="img/${esc(c.im)}_t.jpg" alt="${esc(c.id)}">${boxesSvg(c, img, b)}` +
      `<div class="nums">${nums(c, "a")}${nums(b, "b")}</div></div>`;
  }

  function mark(v) {
    if (v === true) return ' <span class="yes">✓</span>';
    if (v === false) return ' <span class="no">✗</span>';
    return "";
  }

  function trace(c) {
    if (!c.st || !c.st.length) return "";
    const rows = c.st.map((s) => {
      let t = `<b>${esc(s.k)}</b>`;
      if (s.box) t += ` [${s.box.map((v) => Math.round(v)).join(", ")}]`;
      if (s.n) t += ` #${s.n}`;
      if (s.label) t += ` “${esc(s.label)}”`;
      if (s.depth !== undefined) t += ` depth ${s.depth}`;
      if (s.score !== undefined) t += ` score ${fmt(s.score, 3)}`;
      if (s.s !== undefined) t += ` ${fmt(s.s, 3)} s`;
      if (s.ok !== undefined) t += s.ok ? " ok" : ' <span class="err">failed</span>';
      if (s.text) t += `<pre>${esc(s.text)}</pre>`;
      if (s.out) t += `<pre>${esc(s.out)}</pre>`;
      if (s.err) t += ` <span class="err">${esc(s.err)}</span>`;
      return `<div>${t}</div>`;
    });
    return `<details class="trace"><summary>trace (${c.st.length} steps)</summary>${rows.join("")}</details>`;
  }

  function result(c, run, cls, other) {
    if (!c) return `<div class="res ${cls}"><div class="rn">${esc(run.name)}</div><div>not in this run</div></div>`;
    let h = `<div class="res ${cls}"><div class="rn">${esc(run.name)}</div>`;
    h += `<div><span class="badge">${esc(c.r || "(no route)")}</span></div>`;
    if (c.pt !== undefined) h += `<div>P(tool) ${fmt(c.pt, 3)}</div>`;
    if (c.op !== undefined) h += `<div>operating point ${esc(c.op)}</div>`;
    if (c.cf !== undefined) {
      const tau = run.tau;
      const pass = tau !== null && tau !== undefined ? c.cf > tau : null;
      h += `<div>gate ${fmt(c.cf, 3)}` + (tau !== null && tau !== undefined
        ? ` vs τ ${tau} <span class="gate" title="confidence against tau"><i style="width:${(100 * c.cf).toFixed(1)}%"></i>` +
          `<b style="left:${(100 * tau).toFixed(1)}%"></b></span> ${pass ? "pass" : "below"}` : "") +
        (c.tk !== undefined ? ` <small>(${c.tk} tokens)</small>` : "") + "</div>";
    }
    if (c.sa !== undefined) h += `<div>small: “${esc(c.sa)}”${mark(c.sc)}</div>`;
    if (c.aa !== undefined) h += `<div>agent: “${esc(c.aa)}”${mark(c.ac)}</div>`;
    const differ = other && norm(other.p) !== norm(c.p);
    h += `<div>final: <b${differ ? ' class="differs-answer"' : ""}>“${esc(c.p === undefined ? "" : c.p)}”</b>` +
      `${c.ok ? ' <span class="yes">right</span>' : ' <span class="no">wrong</span>'}</div>`;
    if (c.tc || c.itc) h += `<div>tool calls ${c.tc || 0}` + (c.itc ? ` <span class="err">(+${c.itc} invalid)</span>` : "") + "</div>";
    if (c.t) {
      h += "<div><small>" + Object.entries(c.t).map(([k, v]) => `${esc(k)} ${fmt(v, 3)}s`).join(" · ") +
        (c.tt !== undefined ? ` = ${fmt(c.tt, 3)}s` : "") + "</small></div>";
    }
    if (c.e) h += `<div class="err">error: ${esc(c.e)}</div>`;
    if (c.ae) h += `<div class="err">agent error: ${esc(c.ae)}</div>`;
    return h + trace(c) + "</div>";
  }

  function card(c) {
    const b = S.cmp >= 0 ? byId[S.cmp].get(c.id) : null;
    const diff = differs(c, b);
    const letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let h = `<article class="card ${c.ok ? "right" : "wrong"}${diff ? " differs" : ""}" data-id="${esc(c.id)}"` +
      ` data-route="${esc(c.r)}" data-ok="${c.ok ? 1 : 0}">`;
    h += figure(c, b) + '<div class="body">';
    h += `<div class="qid">${esc(c.id)}${c.c ? " · " + esc(c.c) : ""}` +
      (diff ? ' <span class="badge diff">answers differ</span>' : "") + "</div>";
    h += `<p class="q">${esc(c.q || "")}</p>`;
    if (c.o) {
      h += '<ol class="opts" type="A">' + c.o.map((o, i) =>
        `<li${letters[i] === c.g ? ' class="gold"' : ""}>${esc(o)}</li>`).join("") + "</ol>";
    }
    if (c.g !== undefined) h += `<div>gold: <b>${esc(c.g)}</b></div>`;
    h += '<div class="cols">' + result(c, D.runs[S.run], "a", b);
    if (S.cmp >= 0) h += result(b, D.runs[S.cmp], "b", c);
    return h + "</div></div></article>";
  }

  function more() {
    const next = list.slice(shown, shown + CHUNK);
    if (next.length) $("cards").insertAdjacentHTML("beforeend", next.map(card).join(""));
    shown += next.length;
    status();
  }

  function status() {
    const total = D.runs[S.run].cards.length;
    const el = $("status");
    el.dataset.matching = list.length;
    el.dataset.shown = shown;
    el.textContent = `${list.length} of ${total} queries match; ${shown} shown` +
      (S.cmp >= 0 ? ` · compared with ${D.runs[S.cmp].name}` : "");
    $("more").hidden = shown >= list.length;
  }

  function update() {
    writeHash();
    list = sorted(D.runs[S.run].cards.filter(keep));
    shown = 0;
    $("cards").innerHTML = "";
    more();
  }

  function lightbox(key, id) {
    const img = D.images[key];
    const c = byId[S.run].get(id);
    const b = S.cmp >= 0 ? byId[S.cmp].get(id) : null;
    const lb = $("lightbox");
    const w = `min(96vw, ${(92 * img.w / img.h).toFixed(2)}vh)`;
    lb.innerHTML = `<div class="lb-fig" style="aspect-ratio:${img.w}/${img.h};width:${w}">` +
      `<img src="img/${esc(key)}_f.jpg" alt="${esc(id)}">${boxesSvg(c, img, b)}</div>` +
      `<div class="lb-cap">${esc(id)} · ${img.w}×${img.h} · orange: this run's zooms in order, blue dashed: ` +
      "compared run's, green dotted: the target · click to close</div>";
    lb.hidden = false;
  }

  $("cards").addEventListener("click", (ev) => {
    const fig = ev.target.closest(".fig[data-img]");
    if (fig) lightbox(fig.dataset.img, fig.closest(".card").dataset.id);
  });
  $("lightbox").addEventListener("click", () => { $("lightbox").hidden = true; });
  document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") $("lightbox").hidden = true; });
  $("more").querySelector("button").addEventListener("click", more);
  if ("IntersectionObserver" in window) {
    // Re-observing after each chunk asks again, so a tall screen fills up without scrolling.
    new IntersectionObserver((entries, obs) => {
      if (!entries.some((e) => e.isIntersecting) || shown >= list.length) return;
      more();
      obs.unobserve($("more"));
      obs.observe($("more"));
    }, { rootMargin: "600px" }).observe($("more"));
  }
  window.addEventListener("hashchange", () => { readHash(); controls(); update(); });
  readHash();
  controls();
  update();
})();
