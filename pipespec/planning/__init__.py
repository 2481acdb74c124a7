"""Planning: which stages to run, on which devices, how far ahead (`pipespec plan`, design 5b).

- `placement`: what a device is, and which device each stage of a chain runs on
- `profiling`: what each stage's forwards cost and how often each pair agrees, measured here
- `analytical`: PipeSpec's analytical throughput models
- `plan`: the recommendation built from the three, the verdict of its trials (run by pipespec.cli.trials),
  and the config it writes
"""
