"""speceyes as a model of lmms-eval (``lmms-eval --model speceyes``).

lmms-eval finds the model through the ``lmms_eval.models`` entry point, which names
:func:`manifest`. The model class (:mod:`speceyes.lmms.model`) runs the whole funnel inside
``generate_until``; its ``--model_args`` are read by :mod:`speceyes.lmms.args`, each request
becomes a query by :mod:`speceyes.lmms.queries`, and the funnel's own numbers (beta, alpha, time
per route, speedup) are computed by :mod:`speceyes.lmms.metrics`.

Only :func:`manifest` and the model module import lmms-eval; the rest of this package does not.
"""

from __future__ import annotations

from typing import Any

MODEL_ID = "speceyes"
MODEL_CLASS = "speceyes.lmms.model.SpecEyesLMMS"


def manifest() -> Any:
    """The entry point's payload: a chat model (lmms-eval gives it each document's messages)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(MODEL_ID, chat_class_path=MODEL_CLASS)
