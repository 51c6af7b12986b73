"""Float8 training (parallel/float8.py): config and refusals, the conversion filter, emulated parity on gloo,
checkpoints across float8 and plain runs, the export, and the long comparison with the plain run (slow)."""
