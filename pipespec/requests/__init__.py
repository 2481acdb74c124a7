"""A request's way in and out: from what a user gives to what the stages are told, and back.

- `generate_args`: `GenerateArgs`, one request's arguments as every way in takes them, checked once
- `chat`: conversations (system, user and assistant turns)
- `images`, `processors`: decoding the user's picture and letting the target's processor place it
- `tokenization`: a tokenizer per model directory, shared by the stages, decoded incrementally
- `frontdoor`: `GenerateArgs` validated against a pipeline into a `RequestSpec`, or a clear error
- `stopping`: the stop rules (EOS, max tokens, stop strings) applied at commit time
- `outputs`: what clients receive (`Delta`, `Generation`) and the errors they raise
"""
