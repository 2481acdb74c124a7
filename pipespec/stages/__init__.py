"""The stage kinds (design sections 3 and 6): what each kind is, and the stages themselves.

(The table of stage kinds and where a stage's model is, which the config reads, are below it: pipespec.schema.)
- `build_context`: what building one stage needs besides its spec (`BuildContext`)
- `build`: each kind's builder by name; `build_stage`, `load_stages`, `check_vocabularies`
- `causal_lm`, `vlm`, `mock`, `ngram`, `stand`, `dream/`: one stage class per kind, each built from its `StageSpec`;
  `ngram_memory`: what a STAND drafter remembers of the target's distributions; `model_stage`: what the model
  stages (causal_lm, vlm) and their sessions share: shapes, packed forwards, KV caches, admission
- `static_kv`: a request's KV cache at a fixed length (`StaticKV`); `kv_pool`: a stage's caches, sized to
  what a request can use, admitted within the stage's budget, reused across requests (`KVPool`);
  `forwards`: the fixed shapes of the model kinds' forwards (`Shapes`), why they make logits independent
  of the block, and the DREAM stage's one-request forwards; `packing` and `packed_forwards`: the Hugging
  Face stages' forwards, every ready request's tokens packed into one, attention per request (why a
  request's logits do not depend on what shares its forward); `cuda_graphs`: one-request forwards
  replayed from CUDA graphs captured per cache and width (`GraphedStep`); `invariance`: what a target on a CPU
  measures when it starts so that a row's result is its own (the least rows a forward, the attention query
  step, the weights' layout); `weight_layout`: fp32 linear weights stored column-major on a CPU (faster
  few-row products), or row-major again where only that keeps batched forwards exact
- `vocabulary`: one vocabulary for the whole pipeline; `device`: the torch device a stage computes on

Importing the package imports nothing: torch loads with the stage modules that need it.
"""
