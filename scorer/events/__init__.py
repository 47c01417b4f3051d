"""KV-event ingestion: wire decoding, ZMQ subscribers with sequence/replay, the app component."""

from scorer.events.ingest import EventIngest
from scorer.events.subscriber import StreamStatus

__all__ = ["EventIngest", "StreamStatus"]
