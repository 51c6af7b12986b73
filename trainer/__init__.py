"""The program a user runs: CLI, config, launch environment, data, optimizer, training loop,
metrics and checkpoints; the tools that run the trainer's code (estimate, plan, tune) in tools/."""
