"""A pipeline's parts, built from its config and connected: the same wiring for every way it runs.

- `assembly`: the coordinator's side (`Entrance`: front door, coordinator, detokenizer) and the links
  between stage runners, in process or over gRPC streams (imported when called: no gRPC at import)

The Ray side (placement groups, actors, supervision) is pipespec.cluster; in one process, pipespec.local.
"""
