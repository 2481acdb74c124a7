"""Ray: placement groups, one actor per stage, the coordinator actor, and the `ray job submit`
entrypoint (`python -m pipespec.cluster.launch CONFIG`). The only package that imports ray: Ray places the
actors, gRPC streams (pipespec.transport) carry the tokens."""
