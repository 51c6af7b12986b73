"""The parallel layout checked in one process (a fake process group or a one-rank mesh): refusals,
the tables of choices, what each rank holds and the collectives a step issues."""
