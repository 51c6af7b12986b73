"""Mixture-of-experts layouts: expert parallelism (with FSDP, HSDP, TP, CP, PP, checkpointing, compile)
against one process, its config errors, and checkpoints resharded across ep degrees."""
