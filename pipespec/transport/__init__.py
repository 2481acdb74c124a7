"""The transport: the only package that imports grpc.

- `streams`: stage-to-stage and coordinator-to-stage links over bidirectional gRPC streams.
- `coordinator_service`: the coordinator's `Generate` / `Cancel` / `Health` server for clients.
- `health`: the standard grpc.health.v1 service on the coordinator's and every stage's server.
- `generate_client`: the client side of `Generate`, used by `pipespec.client.Client`.
- `generate_request`: a request's `GenerateArgs` to and from the wire's `GenerateRequest`.
- `generate_response`: a `Delta` to and from the wire's `GenerateResponse`.
- `auth`: the per-pipeline secret that stage links and the coordinator's control calls require.
"""
