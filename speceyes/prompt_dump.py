"""``speceyes prompts``: the exact messages each phase sends, as JSON, without any model.

Images are shown as placeholders with the size the model is handed (before its own processor
resizes it), so anyone can see what a model is shown under either protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Any

from speceyes import protocols
from speceyes.images import View, view_for_model
from speceyes.types import Query


class _Geometry:
    """Just enough of a Qwen2.5-VL backend for an agent to open its first turn."""

    name = "geometry"
    box_coords, scores = "absolute", "logits"
    factor, min_pixels, max_pixels = 28, 4 * 28 * 28, 16384 * 28 * 28
    max_images = max_logprobs = None

    def view_of(self, image: Any) -> View:
        return view_for_model(image, self.factor, self.min_pixels, self.max_pixels)


def _plain(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "size": list(p["image"].size)}
                if p.get("type") == "image" and hasattr(p.get("image"), "size")
                else dict(p)
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def dump_prompts(
    queries: Iterable[Query], limit: int | None, protocol: str, agent: str = "deepeyes"
) -> list[dict[str, Any]]:
    """Per query: the phase I (judge), phase II (small model) and first agent-turn messages."""
    from speceyes.factory import AgentSettings, make_agent

    rules = protocols.get_protocol(protocol)
    family = rules.family_of(agent)
    loop_agent = make_agent(AgentSettings(kind=family), _Geometry(), protocol=protocol)
    out = []
    try:
        for q in islice(queries, limit):
            loop = loop_agent.start_loop(q)
            out.append(
                {
                    "id": q.id,
                    "protocol": protocol,
                    "agent": family,
                    "judge": _plain(rules.judge_messages(family, q.image, q.question, q.options)),
                    "small": _plain(rules.small_messages(family, q.image, q.question, q.options)),
                    "agent_first_turn": _plain(loop.messages),
                }
            )
            if hasattr(loop_agent, "_end"):
                loop_agent._end(loop)
    finally:
        if hasattr(loop_agent, "close"):
            loop_agent.close()
    return out
