"""Envoy data path: the ext_proc servicer and the endpoint-picker protocol helpers."""

from scorer.extproc.servicer import ExtProcServicer, add_to_server

__all__ = ["ExtProcServicer", "add_to_server"]
