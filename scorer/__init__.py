"""kv-scorer: a KV-cache-aware endpoint picker for LLM serving behind Envoy."""

__version__ = "0.1.0"
