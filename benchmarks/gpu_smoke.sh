#!/usr/bin/env bash
# GPU smoke check (at most 8 minutes): the transformers backend on CUDA, bundled mini-world
# models, bf16 and fp32 with sdpa, 40 mini-world questions, compared with the CPU run committed
# in benchmarks/gpu_smoke/reference.json. Needs only this checkout, torch, transformers, numpy
# and pillow. Extra arguments go to benchmarks/gpu_smoke.py (e.g. --device cpu, --out FILE).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec timeout 480 "${PYTHON:-python}" "$here/gpu_smoke.py" "$@"
