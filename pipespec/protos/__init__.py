"""The wire contract, `pipespec.proto`, and its generated Python modules `pipespec_pb2` (the messages) and
`pipespec_pb2_grpc` (the services); `build` regenerates them (python -m pipespec.protos.build)."""
