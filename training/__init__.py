"""Training the DREAM drafter against a VLM target, one idea per module:

- `data`: the (image, prompt) samples and the target's answers to them (`Example`)
- `features`: the target's features of one sequence, computed online (`FeatureExtractor`)
- `variants`: the drafter variants the ablations compare (`Variant`, `VARIANTS`)
- `loss`: the two-pass DREAM loss on one sequence (`sequence_loss`)
- `optimiser`: AdamW with warmup then cosine to a floor (`Optimiser`; the demo's models train with it too)
- `loop`: training a fresh drafter (`train`)
- `evaluation`: its mean acceptance length on held-out examples (`mean_acceptance_length`)
- `ablation`: every variant with several seeds, in worker processes (`run_grid`)

The command line is `python -m training.train`.
"""
