"""How a model is spread over devices: ParallelDims and the named mesh, TP, FSDP, pipelining, float8,
activation checkpointing and compile; the analytic planner in its own subpackage (planner/)."""
