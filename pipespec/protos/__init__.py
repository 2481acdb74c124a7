"""The wire contract (pipespec.proto) and its generated Python modules (regenerate: python -m pipespec.protos.build)."""
