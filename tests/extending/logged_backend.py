"""An engine that runs a model with transformers and logs each call of the funnel and the agents:
which primitive, how many conversations, how long (logger ``speceyes.backends.logged``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from speceyes.backends.base import Backend, Messages
from speceyes.types import ChatTurn, SpecAnswer

if TYPE_CHECKING:
    from speceyes.factory import BackendSettings

log = logging.getLogger("speceyes.backends.logged")


class LoggedBackend:
    """Another backend's model with each of its calls logged. Its capabilities (box_coords,
    factor, pixel limits, scores, max_logprobs, decoding, ...) and any optional method are the
    wrapped backend's."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextmanager
    def _logged(self, method: str, batch: Sequence[Messages]) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        log.info("%s: %d conversations, %.3f s", method, len(batch), time.perf_counter() - t0)

    def view_of(self, image: Any) -> Any:
        return self.inner.view_of(image)

    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        with self._logged("next_token_probs", batch):
            return self.inner.next_token_probs(batch, words, top_logprobs)

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        with self._logged("answer", batch):
            return self.inner.answer(batch, max_new_tokens, top_k)

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        with self._logged("chat", batch):
            return self.inner.chat(batch, stop, max_new_tokens)


def build(spec: str, settings: BackendSettings, *, role: str, shares_device: bool) -> Backend:
    """The engine: the "hf" engine's backend for ``spec``, logged."""
    from speceyes.backends.registry import build_hf

    return LoggedBackend(build_hf(spec, settings, role=role, shares_device=shares_device))
