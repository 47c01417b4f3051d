# kv-scorer — every target creates .venv and installs the pinned dependencies first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick test-vllm fuzz lint typecheck proto bench clean manifests

# The compiled hot paths (scorer/native/_speedups.pyx, Cython) are built by this install; an
# edited .pyx rebuilds them.
$(STAMP): pyproject.toml tools/pyproject.toml scorer/native/_speedups.pyx
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# The runtime (scorer) and, as its own distribution, the tooling (tools/: sim, bench, demo).
	$(PY) -m pip install --quiet -e '.[dev]' -e ./tools
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kv-scorer demo --out demo-out

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider

# The edit loop (under a minute): every test that starts no Envoy and is not marked slow
# (markers: tests/conftest.py). `make test` still runs everything.
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not envoy and not slow"

# Property tests only, exploring randomly with 10x the examples (tests/conftest.py profiles;
# `make test` runs them derandomized). Keep any counterexample as an @example in its test.
fuzz: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m hypothesis --hypothesis-profile=fuzz --hypothesis-show-statistics tests

# Opt-in: real vLLM (CPU) workers in their own .venv-vllm; see README "Real vLLM tier".
test-vllm: $(STAMP)
	bash tools/test-vllm.sh $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check scorer tools tests bench tests_vllm deploy
	$(VENV)/bin/ruff format --check scorer tools tests bench tests_vllm deploy

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Regenerate the scorer.v1 gRPC stubs (committed; tests/test_proto_stubs.py fails when stale).
proto: $(STAMP)
	$(PY) -m scorer.api.protogen

# Re-render deploy/manifests/ from deploy/values.yaml (make test fails when they differ).
manifests: $(STAMP)
	$(PY) deploy/render.py --write

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .venv-vllm demo-out .mypy_cache .ruff_cache build scorer/native/_speedups.c scorer/native/*.so
