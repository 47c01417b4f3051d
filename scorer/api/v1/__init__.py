"""Generated scorer.v1 stubs (python -m scorer.api.protogen)."""
