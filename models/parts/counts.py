"""Element-wise counts shared by the parts' declarations: elements read plus written per feature of one
forward, as torch runs each op (eager) and as one fused kernel per chain (compiled). Counted against every
aten op of a real block in tests/planner/test_work.py and tests/planner/test_mla_measured.py."""

RMSNORM_EAGER, RMSNORM_COMPILED = 8, 2  # pow, mean, rsqrt, two multiplies; fused: read and write
LAYERNORM_EAGER = 2  # one fused kernel either way
ROPE_EAGER, ROPE_COMPILED = 10, 2  # neg, cat, two multiplies, add; fused
RESIDUAL_EAGER = 3  # a residual add reads two and writes one
NORM_AND_RESIDUAL_COMPILED = 4  # residual add + norm fused: read two, write two
