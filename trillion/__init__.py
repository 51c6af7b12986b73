"""Trillion: one installed name for the trainer's layers (trillion.kernels <- trillion.models <-
trillion.parallel <- trillion.trainer) and, below them all, the user-error types and the device table."""
