"""gRPC health (grpc.health.v1) with the inference extension's service names.

"" and "readiness" follow readiness (NOT_SERVING from the first moment of a shutdown),
"liveness" stays SERVING until the process exits, and the ext_proc service name follows
readiness so Envoy's gRPC health check on the ext_proc cluster drains us too.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS_NAMES = ("", "readiness", EXTPROC_SERVICE)
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
