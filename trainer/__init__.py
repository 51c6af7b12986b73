"""The program a user runs: the training loop (train.py) and its step, assembly, optimizer, evaluation, resilience
and pre-flight checks at this level; the components it is built from in subpackages, one concern each."""
