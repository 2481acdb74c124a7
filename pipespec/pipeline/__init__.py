"""A whole pipeline, above its stages: how it is assembled and how its requests are coordinated.

- `assembly`: how a config's parts are built and connected, the same for every way it runs
- `coordinator`: opens requests on every stage and turns the target's commits into a client stream
- `ledger`: the committed prefix of each request, and nothing else

Torch-free, like the coordinator itself (tests/test_layering.py checks it).
"""
