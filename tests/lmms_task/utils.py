"""Mini-world tasks in lmms-eval's POPE and V* layouts, scored by those tasks' own functions.

The documents hold an image path (the test writes them beside a generated mini-world split);
prompts, per-document scoring and aggregation are lmms-eval's ``pope`` and ``vstar_bench``
functions, so a speceyes answer counts here exactly as it would on those benchmarks.
"""

from lmms_eval.tasks.pope.utils import (  # noqa: F401  (named by the task YAMLs)
    pope_aggregate_accuracy,
    pope_aggregate_f1_score,
    pope_doc_to_text,
    pope_process_results,
)
from lmms_eval.tasks.vstar_bench.utils import (  # noqa: F401
    vstar_aggregate_results,
    vstar_doc_to_text,
    vstar_process_results,
)
from PIL import Image


def doc_to_visual(doc):
    with Image.open(doc["image"]) as image:
        return [image.convert("RGB")]
