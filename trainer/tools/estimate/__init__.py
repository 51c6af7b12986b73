"""`trillion estimate`: the real model and layout built on the meta device under a fake process group, one
simulated rank at a time (rank.py, activations.py), its memory per rank (dry_run.py), advice and the CLI."""
