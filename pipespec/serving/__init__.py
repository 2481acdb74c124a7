"""Serving a running coordinator to clients: every way in shares one `Serving` (pipespec.serving.serving).

The coordinator's gRPC `Generate` (pipespec.transport.coordinator_service) and the OpenAI-compatible
HTTP server (pipespec.serving.openai_app) both admit requests through `Serving`, so the same front
door refuses the same bad values, and the same Prometheus metrics (pipespec.serving.metrics) count
every request whichever way it came.
"""
