# kv-scorer runtime image: the scorer (`kv-scorer serve`) and nothing else. The simulator,
# the load generator and the benchmarks are the kv-scorer-tools distribution, built into
# their own image by tools/Dockerfile. Envoy runs from the official envoyproxy/envoy image.
#   docker build -t kv-scorer:0.1.0 .

# Build stage: a C compiler for the compiled hot paths (scorer/native, Cython), then the
# scorer and its pinned dependencies installed into a virtualenv the runtime stage copies
# (the runtime image carries no compiler).
FROM python:3.11.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/kv-scorer
COPY pyproject.toml README.md ./
COPY scorer ./scorer
# Runtime dependencies are pinned in pyproject.toml, the build (setuptools, Cython) in its
# [build-system] table.
RUN pip install --no-compile .
# The extension is optional to pip (an install without a compiler falls back to pure
# Python); this image must carry it. Run outside the source tree so the installed copy is
# the one imported.
RUN cd / && python -c "from scorer.native import NATIVE; assert NATIVE is not None, 'scorer.native was not built'"

FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

COPY --from=build /opt/venv /opt/venv
WORKDIR /opt/kv-scorer

# 65532: the conventional "nonroot" uid; nothing here needs root.
USER 65532:65532
# ext_proc gRPC, gRPC health, admin/metrics HTTP (the inference extension's ports)
EXPOSE 9002 9003 9090
ENTRYPOINT ["kv-scorer"]
CMD ["serve", "--config", "/etc/kv-scorer/scorer.yaml"]
