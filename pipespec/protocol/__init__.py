"""The pipeline protocol (design section 2): what travels between stages and the coordinator. Torch-free.

- `messages`: Open, Draft, Verdict, Commit, Close and the rest: frozen, small, deltas only
- `params`: a request's sampling parameters
- `tree_shape`: the shape of the draft trees a drafter grows (its `tree` section)
- `logprobs`: the target's logprob of a token and its top alternatives
- `stats`: statistics per stage pair, named like vLLM's spec-decode metrics
- `codec`: messages <-> msgpack bytes, the payload of every gRPC frame
- `links`: how a message gets from one endpoint to another (in-process queues; gRPC in pipespec.transport)
"""
