# kv-scorer: one image for the scorer (`serve`), the simulated workers (`sim`) and the
# load generator (`demo --target`). Envoy runs from the official envoyproxy/envoy image.
#   docker build -t kv-scorer:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kv-scorer
COPY pyproject.toml README.md ./
COPY scorer ./scorer
# Runtime dependencies are pinned in pyproject.toml. The stub tokenizer lets the scorer
# accept the demo's token-id prompts for the model "bench-model" (ids are taken as they
# are; the tokenizer never encodes anything).
RUN pip install --no-compile . \
 && python -c "from pathlib import Path; from scorer.bench.e2e import write_stub_tokenizer; write_stub_tokenizer(Path('/opt/kv-scorer/tokenizer/tokenizer.json'))"

# 65532: the conventional "nonroot" uid; nothing here needs root.
USER 65532:65532
# ext_proc gRPC, gRPC health, admin/metrics HTTP (the inference extension's ports)
EXPOSE 9002 9003 9090
ENTRYPOINT ["kv-scorer"]
CMD ["serve", "--config", "/etc/kv-scorer/scorer.yaml"]
