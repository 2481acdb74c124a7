"""What a pipeline config is made of, below the config that reads it (torch-free; the standard library and
`pipespec.errors` only, with huggingface_hub's cache lookup for a hub id).

- `kinds`: the table of stage kinds: each kind's own config keys (its options), where it may sit in a chain, what it
  can do
- `model_source`: where a stage's model is: a directory, or a Hugging Face hub id in the local cache
"""
