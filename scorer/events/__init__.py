"""KV-event ingestion: wire decoding, ZMQ subscribers with sequence/replay, the app component."""
