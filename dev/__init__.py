"""One-off investigations: each answered a question once, and its finding is recorded where it cites (the README
under experiments/results/ that names its command). Not benchmarks a user runs (those are in experiments/); kept
runnable (`python -m dev.NAME --help`), outside the runtime and its wheel.

- `batch_invariance`: does a row's result depend on the other rows of its product (the batched steps' premise)
- `batched_target`: the target alone, batched, at 1 to N requests in flight
- `core_interference`: do two devices of this machine slow each other down
- `demo_attention`: does the demo target look at the shape a question asks about
- `demo_shapes`: the demo target's shape, chosen by cost and accuracy in a training budget
- `draft_ranks`: where a drafter ranks its target's token (what pre-drafting and trees can win)
- `exact_dtype`: is the pipeline's answer the target alone's in a given dtype
- `hf_batched`: Hugging Face `generate` with left-padded batches, the outside reference for batched serving
- `host_work`: the runtime's host work per target step at each depth
- `noise_cost`: what the coupled-sampling noise costs on a CPU
- `train_cost`: what a step of the demo target's training costs against its arithmetic
"""
