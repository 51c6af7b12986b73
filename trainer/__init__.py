"""The program a user runs: CLI, config, launch environment, data, optimizer, training loop,
metrics and checkpoints."""
