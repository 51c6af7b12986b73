"""What the tests share, imported as `tests.helpers.<module>` (pytest puts the repository root on sys.path):

- flags: the small-run flag lists (`with_flags` and `without` derive a test's own from them)
- runs: tiny in-process training runs and what they leave (losses, checkpoints, exports)
- launch: `trillion train` as a subprocess (one process or torchrun), its records compared
- spawn: N gloo ranks in spawned interpreters (`run_ranks`), as torchrun would have set them up
- parity, pp_parity: the gradient-by-gradient comparison of a layout with one process
- real_run: the real gloo side of the estimate's exactness checks
- fault_record: the fault matrix's records; wandb_records: an offline W&B run's records
"""
