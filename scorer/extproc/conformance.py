"""Test-only request and response devices of the inference extension's conformance picker
(both off by default; `extproc.test_endpoint_selection`, `extproc.echo_served_endpoint`).

- `test-epp-endpoint-selection: IP[,IP:port...]` restricts the request's eligible
  endpoints: an IP entry allows every port on that IP (data-parallel ranks), an `IP:port`
  entry exactly that endpoint (gateway-api-inference-extension v1.5.0
  `pkg/epp/framework/plugins/scheduling/test/consts.go`,
  `.../scheduling/test/filter/request_header_based_filter.go`). A present but empty
  header allows nothing (503), as there.
- `x-conformance-test-served-endpoint` on the response: the endpoint Envoy reported it
  used (`envoy.lb/x-gateway-destination-endpoint-served`), or the reference's "fail: ..."
  text when Envoy reported none (`pkg/epp/framework/plugins/requestcontrol/test/
  responsereceived/destination_endpoint_served_verifier.go`).

Never turn these on for real traffic: a client could steer its own requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from scorer.extproc import protocol as P

SELECTION_HEADER = "test-epp-endpoint-selection"
SERVED_HEADER = "x-conformance-test-served-endpoint"
_MAX_ENTRIES = 64  # the header is client input: bounded


def selection(headers: Mapping[str, str]) -> frozenset[str] | None:
    """The entries of the selection header (IPv6 brackets dropped from IP-only entries),
    or None when the header is absent."""
    raw = headers.get(SELECTION_HEADER)
    if raw is None:
        return None
    out = set()
    for item in raw.split(",")[:_MAX_ENTRIES]:
        item = item.strip()
        if not item:
            continue
        if item.startswith("[") and item.endswith("]"):
            item = item[1:-1]  # "[fd00::1]" is the IP fd00::1, any port
        out.add(item)
    return frozenset(out)


def restrict(
    hint: frozenset[str] | None,
    selected: frozenset[str] | None,
    endpoints: Iterable[tuple[str, str]],
) -> frozenset[str] | None:
    """Combine the gateway's subset hint with the selection header: the exact endpoints
    (from `endpoints`, (endpoint, ip) pairs of the pool) allowed by both."""
    if selected is None:
        return hint
    if hint is None:
        return selected
    return frozenset(
        ep
        for ep, ip in endpoints
        if (ep in hint or ip in hint) and (ep in selected or ip in selected)
    )


def served_response(req: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """A response-headers CONTINUE that adds the served-endpoint echo header."""
    served = P.served_endpoint(req)
    if served is None:
        fm = req.metadata_context.filter_metadata
        served = (
            "fail: missing destination endpoint served metadata"
            if P.DESTINATION_NAMESPACE in fm
            else "fail: missing envoy lb metadata"
        )
    mutation = ep.HeaderMutation()
    mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            # Envoy 1.40 takes header values from ext_proc in raw_value only.
            header=base_pb2.HeaderValue(key=SERVED_HEADER, raw_value=served.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    return P.continue_headers(mutation, response_path=True)
