"""Several processes on gloo (spawned ranks or torchrun): each parallel layout reproduces the one-process run."""
