"""kv-scorer's development tooling: simulated workers, benchmarks, the demo, Envoy runner.

Its own distribution (`kv-scorer-tools`, tools/pyproject.toml), installed next to the
runtime `kv-scorer` for development; the runtime package never imports it. Its CLI
subcommands (`kv-scorer sim|bench|demo`) register through the `kv_scorer.commands`
entry-point group.
"""
