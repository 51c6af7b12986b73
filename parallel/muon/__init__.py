"""Muon and MuonClip (Kimi K2's optimizer): which parameters are hidden matrices, Newton-Schulz, the step
distributed over any layout's shards, and the per-head QK-clip; torch-free at this level (the planner reads it)."""
