"""Public surfaces besides the Envoy data path: admin HTTP, gRPC health, scorer.v1."""
