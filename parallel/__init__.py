"""How a model is spread over devices: the device mesh and parallelisms, and the tools that
reason about layouts before any GPU is used (device and hardware tables)."""
