"""The coordinator and how it is served to clients.

- `coordinator`: opens requests on every stage, turns the target's commits into a client stream
- `ledger`: the committed prefix of each request, and nothing else
- `drain`: a server told to stop refuses new requests, lets running ones finish, then ends those left with an error
- `serving`: `Serving`, the one way in that every protocol shares: the coordinator's gRPC `Generate`
  (pipespec.transport.coordinator_service) and the OpenAI-compatible HTTP server (`openai_app`, run by
  `http_server`) both admit requests through it, so the same front door refuses the same bad values
  and the same Prometheus metrics (`metrics`) count every request whichever way it came
- `openai_protocol`, `openai_responses`, `openai_errors`, `media`: the OpenAI API's requests, answers,
  errors and `image_url`s; `body_limit`, `in_flight`, `fan_in`: the HTTP server's limits and `n`

Torch-free, like the coordinator (tests/test_layering.py checks it).
"""
