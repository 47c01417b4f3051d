# kv-scorer runtime image: the scorer (`kv-scorer serve`) and nothing else. The simulator,
# the load generator and the benchmarks are the kv-scorer-tools distribution, built into
# their own image by tools/Dockerfile. Envoy runs from the official envoyproxy/envoy image.
#   docker build -t kv-scorer:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kv-scorer
COPY pyproject.toml README.md ./
COPY scorer ./scorer
# Runtime dependencies are pinned in pyproject.toml.
RUN pip install --no-compile .

# 65532: the conventional "nonroot" uid; nothing here needs root.
USER 65532:65532
# ext_proc gRPC, gRPC health, admin/metrics HTTP (the inference extension's ports)
EXPOSE 9002 9003 9090
ENTRYPOINT ["kv-scorer"]
CMD ["serve", "--config", "/etc/kv-scorer/scorer.yaml"]
