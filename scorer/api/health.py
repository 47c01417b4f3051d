"""gRPC health (grpc.health.v1) with the inference extension's service names.

"", "readiness" and "inference-extension" follow readiness (NOT_SERVING until the
start-up gate of scorer/api/readiness.py opens, and from the first moment of a shutdown);
"liveness" stays SERVING until the process exits; the ext_proc service name follows
readiness so Envoy's gRPC health check on the ext_proc cluster drains us too.

Names probed by the reference deployments: "inference-extension" (liveness AND readiness
with one replica) and "liveness"/"readiness" (several replicas) on port 9003 —
gateway-api-inference-extension v1.5.0 `config/charts/epplib/templates/_deployment.yaml`,
llm-d/llm-d-router `config/charts/routerlib/templates/_deployment.yaml`; the ext_proc
service name — llm-d-router `deploy/components/inference-gateway/deployment.yaml`.
The reference answers unknown names SERVICE_UNKNOWN; grpcio's servicer answers NOT_FOUND.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
INFERENCE_EXTENSION = "inference-extension"
READINESS_NAMES = ("", "readiness", INFERENCE_EXTENSION, EXTPROC_SERVICE)
LIVENESS_NAMES = ("liveness",)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """One health servicer shared by the health port and the ext_proc port."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self.ready = False

    async def set_ready(self, ready: bool) -> None:
        """Readiness names SERVING/NOT_SERVING; liveness always SERVING."""
        self.ready = ready
        status = SERVING if ready else NOT_SERVING
        for name in READINESS_NAMES:
            await self.servicer.set(name, status)
        for name in LIVENESS_NAMES:
            await self.servicer.set(name, SERVING)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
