"""What every command line shares (`pipespec`, the Ray job's `pipespec.cluster.launch`, the experiments,
the demo's training): the parts below the commands themselves.

- `logs`: logging set up the same way by every command and actor (`--log-level`, a config file)
- `examples`: the example configs shipped in pipespec/configs, by name (`pipespec serve mock3`)
- `ports`: a port checked free before a command starts anything (`pipespec serve`)
"""
