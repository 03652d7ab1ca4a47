"""``lmms-eval --model speceyes``: the whole funnel inside ``generate_until``.

lmms-eval hands the model every request of a run at once; they go through the funnel as one
stream of queries (in the funnel's batches, batched or pipelined as ``schedule=`` says), and
each answer comes back in the form its task scores (:func:`speceyes.lmms.queries.task_answer`).
Images are read from the documents as the funnel draws its batches, so a run never holds more
than the funnel's batches in flight.

The funnel's numbers (:mod:`speceyes.lmms.metrics`) go to lmms-eval through its
``gen_metrics.log_metrics``: they appear in the results' ``throughput`` block and in its
"Throughput Summary" table as ``avg_speceyes_*`` (one call per run, so each is the run's
value). ``output=DIR`` also writes ``DIR/speceyes_metrics.json`` (every number, per task and
overall) and ``DIR/speceyes_samples.jsonl`` (each query's route, answers, confidence, timings).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics, space_tokenizer
from loguru import logger
from tqdm import tqdm

from speceyes.factory import build_funnel
from speceyes.lmms.args import settings_from_model_args
from speceyes.lmms.metrics import funnel_metrics, lmms_metrics
from speceyes.lmms.queries import ANSWER_FORMATS, query_id, request_query, task_answer
from speceyes.types import Query, Result

METRICS_FILE = "speceyes_metrics.json"
SAMPLES_FILE = "speceyes_samples.jsonl"


class SpecEyesLMMS(lmms):
    """A chat model of lmms-eval whose answers come from a SpecEyes funnel."""

    is_simple = False

    def __init__(
        self,
        answer: str = "auto",
        output: str | None = None,
        batch_size: Any = 1,
        max_batch_size: Any = None,  # lmms-eval's; the funnel's batch size is batch_size's
        device: str | None = None,
        **model_args: Any,
    ) -> None:
        super().__init__()
        if answer not in ANSWER_FORMATS:
            raise ValueError(f"answer must be one of {', '.join(ANSWER_FORMATS)}, got {answer!r}")
        self.answer_format = answer
        self.output = None if output is None else Path(str(output))
        self.settings = settings_from_model_args(model_args, batch_size=batch_size, device=device)
        self.funnel = build_funnel(self.settings)
        self.batch_size = self.funnel.config.batch_size
        self.last_metrics: dict[str, Any] | None = None

    # ---- lmms-eval's request types ---------------------------------------------------------
    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(
            "speceyes answers generate_until tasks only: the funnel routes each query to a small "
            "model's answer or a large model's agent loop, and neither scores a given "
            "continuation; choose a task whose output_type is generate_until"
        )

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError(
            "speceyes answers single-round generate_until tasks: the agent loop plans its own "
            "turns; choose a task whose output_type is generate_until"
        )

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        ids = _unique_ids(requests)
        options: dict[str, list[str] | None] = {}
        tasks: dict[str, str] = {}
        results: dict[str, Result] = {}
        bar = tqdm(total=len(requests), disable=self.rank != 0, desc="speceyes")

        def queries() -> Iterator[Query]:
            for qid, req in zip(ids, requests, strict=True):
                _ctx, doc_to_messages, _gen_kwargs, doc_id, task, split = req.args
                tasks[qid] = task
                try:
                    doc = self.task_dict[task][split][doc_id]
                    q = request_query(doc, doc_to_messages(doc), qid)
                except Exception as e:  # this document's failure is its own error result
                    error = f"{type(e).__name__}: {e}"
                    results[qid] = Result(id=qid, answer="", route="error", error=error)
                    options[qid] = None
                    bar.update(1)
                    continue
                options[qid] = q.options
                yield q

        t0 = time.perf_counter()
        with bar:
            for r in self.funnel.iter_results(queries()):
                results[r.id] = r
                bar.update(1)
        wall = time.perf_counter() - t0
        ordered = [results[qid] for qid in ids]
        answers = [task_answer(r.answer, options[r.id], self.answer_format) for r in ordered]
        self._report(ordered, answers, tasks, wall)
        return [
            GenerationResult(a, TokenCounts(output_tokens=int(_generated_tokens(r))))
            for r, a in zip(ordered, answers, strict=True)
        ]

    # ---- the funnel's numbers --------------------------------------------------------------
    def _report(
        self, results: list[Result], answers: list[str], tasks: dict[str, str], wall: float
    ) -> None:
        overall = funnel_metrics(results, wall)
        per_task = {  # the tasks' queries share batches, so only the whole call has a wall time
            task: funnel_metrics([r for r in results if tasks[r.id] == task])
            for task in sorted(set(tasks.values()))
        }
        self.last_metrics = {"overall": overall, "tasks": per_task}
        tokens = sum(_generated_tokens(r) for r in results)
        log_metrics(
            total_elapsed_time=wall,
            total_gen_tokens=int(tokens),
            avg_speed=tokens / wall if wall > 0 else 0.0,
            additional_metrics={"total_requests": len(results), **lmms_metrics(overall)},
        )
        for task, m in per_task.items():
            logger.info(
                f"speceyes {task}: {m['queries']} queries, beta {_fmt(m['beta'])}, "
                f"alpha {_fmt(m['alpha'])}, routes {m['routes']}, speedup {_fmt(m['speedup'])}"
            )
        if self.output is not None:
            self._write(results, answers, tasks)

    def _write(self, results: list[Result], answers: list[str], tasks: dict[str, str]) -> None:
        out = self.output
        out.mkdir(parents=True, exist_ok=True)
        report = {"settings": self.settings.to_dict(), **(self.last_metrics or {})}
        (out / METRICS_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        with open(out / SAMPLES_FILE, "w", encoding="utf-8") as f:
            for r, answer in zip(results, answers, strict=True):
                record = {"task": tasks[r.id], **r.to_dict(), "task_answer": answer}
                f.write(json.dumps(record) + "\n")
        logger.info(f"speceyes: wrote {out / METRICS_FILE} and {out / SAMPLES_FILE}")


def _unique_ids(requests: list[Instance]) -> list[str]:
    """One id per request; a repeated request (lmms-eval's ``repeats``) gets ``#k``."""
    seen: dict[str, int] = {}
    ids = []
    for req in requests:
        _ctx, _msgs, _gen, doc_id, task, split = req.args
        base = query_id(task, split, doc_id)
        k = seen.get(base, 0)
        seen[base] = k + 1
        ids.append(base if k == 0 else f"{base}#{k}")
    return ids


def _generated_tokens(r: Result) -> float:
    """Generated tokens of a query: the small answer's exactly (the gate's logit rows), the
    agent's turns estimated as lmms-eval estimates them for API models (words x 1.5)."""
    small = 0 if r.small_topk is None else len(r.small_topk)
    turns = [s.get("text", "") for s in r.trace if s.get("type") == "assistant"]
    return small + sum(space_tokenizer(t) for t in turns if t)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
