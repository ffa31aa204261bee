#!/usr/bin/env bash
# Install vLLM (empty device target) and the vllm-tt plugin into the ACTIVE Python environment (on a card host:
# the tt-metal python_env, which owns torch, ttnn and numpy<2), then this project without touching its deps.
#
#   source /path/to/tt-metal/python_env/bin/activate
#   scripts/install_vllm_tt.sh [PLUGIN_REF [PLUGIN_REPO]]
#     PLUGIN_REF:  a tenstorrent/vllm-tt-plugin commit/tag/branch (default main)
#     PLUGIN_REPO: where to clone the plugin from (default its GitHub URL; a local clone or mirror works too)
#   PYTHON=/path/to/python overrides the interpreter (default: `python` on PATH)
#
# Why each step (mirrors the plugin's own docs/install-vllm-tt.sh, with pip instead of uv):
# - vLLM's published wheel is the CUDA build, so vLLM comes from its sdist, built with VLLM_TARGET_DEVICE=empty
#   (it then declares no torch dependency) and installed with --no-deps. Only vLLM itself is forced to source
#   (--no-binary vllm): `--no-binary :all:` would also force its build requirements (torch among them) to build
#   from source, and torch publishes no sdist, so that fails on every host. The download runs without the empty
#   target: under it the sdist's metadata says 0.25.1+empty, which pip refuses for the pin ==0.25.1.
# - vLLM's generic dependency list requirements/common.txt is taken from the same sdist and installed separately,
#   before vLLM, without numpy and opencv-python-headless: numpy stays < 2 (ttnn pins it), and opencv >= 4.13 would
#   pull numpy 2, so 4.11.0.86 (the last release without that floor; only vLLM's video IO uses it) goes in instead.
# - The plugin does not declare vLLM (it must be this build, not PyPI's), so it goes in after vLLM; this project
#   goes in last with --no-deps.
set -euo pipefail
VLLM_VERSION=0.25.1
PLUGIN_REF=${1:-main}
PLUGIN_REPO=${2:-https://github.com/tenstorrent/vllm-tt-plugin}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
"$PY" -c "import ttnn" >/dev/null 2>&1 || { echo "install_vllm_tt: ttnn is not importable from $PY (activate the tt-metal env)" >&2; exit 1; }
# vLLM's model registry imports torchvision when it inspects the Qwen3.5/3.6 architectures (without it the engine
# refuses the model as "not supported"); the tt-metal env ships it, matching its torch
"$PY" -c "import torchvision" >/dev/null 2>&1 || { echo "install_vllm_tt: torchvision is not importable from $PY (install the release matching this env's torch)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --no-deps --no-binary vllm "vllm==$VLLM_VERSION" -d "$work"
tar xzf "$work/vllm-$VLLM_VERSION.tar.gz" -C "$work"
grep -v -E '^(opencv-python-headless|numpy)\b' "$work/vllm-$VLLM_VERSION/requirements/common.txt" > "$work/common.txt"
"$PY" -m pip install -r "$work/common.txt" "opencv-python-headless==4.11.0.86" "numpy>=1.24.4,<2"
VLLM_TARGET_DEVICE=empty "$PY" -m pip install --no-deps "$work/vllm-$VLLM_VERSION"
git clone -q "$PLUGIN_REPO" "$work/vllm-tt-plugin"
git -C "$work/vllm-tt-plugin" checkout -q "$PLUGIN_REF"
"$PY" -m pip install "$work/vllm-tt-plugin"
"$PY" -m pip install --no-deps -e "$REPO"
"$PY" - <<'PY'
import vllm, vllm_tt_plugin, qwen36.tt.serving.qwen36_vllm as a
print(f"vllm {vllm.__version__}, vllm_tt_plugin at {vllm_tt_plugin.__file__}, adapter {a.__file__}")
PY
