#!/usr/bin/env bash
# Install vLLM (empty device target) and the vllm-tt plugin into the ACTIVE Python environment (on a card host:
# the tt-metal python_env, which owns torch, ttnn and numpy<2), then this project without touching its deps.
#
#   source /path/to/tt-metal/python_env/bin/activate
#   scripts/install_vllm_tt.sh [PLUGIN_REF]        # PLUGIN_REF: a tenstorrent/vllm-tt-plugin commit/tag (default main)
#
# Why each step (mirrors the plugin's own docs/install-vllm-tt.sh, with pip instead of uv):
# - vLLM's published wheel is the CUDA build; built from the sdist with VLLM_TARGET_DEVICE=empty it declares no
#   torch dependency, so it is installed with --no-deps and its generic list requirements/common.txt (taken from
#   the same sdist) is installed separately.
# - numpy stays < 2 (ttnn pins it); opencv-python-headless >= 4.13 would pull numpy 2, and only vLLM's video IO
#   uses it, so the last release without that floor (4.11.0.86) is installed instead.
set -euo pipefail
VLLM_VERSION=0.25.1
PLUGIN_REF=${1:-main}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
"$PY" -c "import ttnn" 2>/dev/null || { echo "install_vllm_tt: ttnn is not importable from $PY (activate the tt-metal env)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --no-deps --no-binary :all: "vllm==$VLLM_VERSION" -d "$work"
tar xzf "$work/vllm-$VLLM_VERSION.tar.gz" -C "$work"
grep -v -E '^(opencv-python-headless|numpy)\b' "$work/vllm-$VLLM_VERSION/requirements/common.txt" > "$work/common.txt"
"$PY" -m pip install -r "$work/common.txt" "opencv-python-headless==4.11.0.86" "numpy>=1.24.4,<2"
VLLM_TARGET_DEVICE=empty "$PY" -m pip install --no-deps "$work/vllm-$VLLM_VERSION"
git clone -q https://github.com/tenstorrent/vllm-tt-plugin "$work/vllm-tt-plugin"
git -C "$work/vllm-tt-plugin" checkout -q "$PLUGIN_REF"
"$PY" -m pip install "$work/vllm-tt-plugin"
"$PY" -m pip install --no-deps -e "$REPO"
"$PY" - <<'PY'
import vllm, vllm_tt_plugin, qwen36.tt.qwen36_vllm as a
print(f"vllm {vllm.__version__}, vllm_tt_plugin at {vllm_tt_plugin.__file__}, adapter {a.__file__}")
PY
