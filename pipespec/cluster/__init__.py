"""Ray: the only package that imports ray. Ray places the actors; gRPC streams (pipespec.transport) carry
the tokens.

- `launch`: `pipespec serve` and the `ray job submit` entrypoint (`python -m pipespec.cluster.launch CONFIG`)
- `pipeline`: `start_pipeline`, checked, placed and started: a placement group, one actor per device,
  the coordinator, linked (`RunningPipeline`)
- `actors`: the device actor (its stages, runners and gRPC servers) and the coordinator's actor
- `bundles`: one bundle of Ray resources per device, and the placement strategies
- `cores`: which CPU cores each device actor's threads run on
- `supervisor`: puts a running pipeline back together after Ray restarts one of its actors
"""
