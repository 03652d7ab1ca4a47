"""What every backend must do for the funnel and every agent, checked by calling it."""

from __future__ import annotations

import numpy as np

from speceyes import prompts
from speceyes.backends.base import Backend
from tests.conftest import make_scene


def assert_backend_contract(be: Backend) -> None:
    """Geometry, limits and next-token probabilities behave as ``Backend`` documents them."""
    assert be.box_coords in ("absolute", "relative1000") and isinstance(be.name, str)
    assert be.factor in (28, 32) and 0 < be.min_pixels <= be.max_pixels
    for limit in (be.max_images, be.max_logprobs):
        assert limit is None or (isinstance(limit, int) and limit >= 1)
    for size in ((1000, 600), (60, 40)):  # shrunk to max_pixels, grown to min_pixels
        v = be.view_of(make_scene(size=size))
        assert (v.orig_w, v.orig_h) == size
        assert v.view_w % be.factor == 0 and v.view_h % be.factor == 0
        assert be.min_pixels <= v.view_w * v.view_h <= be.max_pixels
    batch = [
        prompts.judge_messages(make_scene(), "Is there a red square?"),
        prompts.judge_messages(make_scene(color=(30, 30, 220)), "Is there a red square?"),
    ]
    p = be.next_token_probs(batch, ["yes", "no", "Yes"])
    assert p.shape == (2, 3) and np.all(p >= 0) and np.all(p.sum(axis=1) <= 1 + 1e-6)
    assert be.next_token_probs([], ["yes"]).shape == (0, 1)
