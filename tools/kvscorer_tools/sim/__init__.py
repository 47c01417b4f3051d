"""Simulated vLLM worker: OpenAI API, paged prefix cache, KV events, timing model."""
