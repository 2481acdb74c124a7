"""What the commands share beyond `pipespec.cli`: the parts every entry point uses, and the demo.

- `logs`: logging set up the same way by every command and actor (`--log-level`, a config file)
- `examples`: the example configs shipped in pipespec/configs, by name
- `demo`: `pipespec demo`, the embedded default, run and measured into a report the CLI prints
"""
