"""`trillion plot`: pictures of what a run recorded (its curves, its pipeline schedule, its replica groups) and of
which ranks hold what in a layout; matplotlib comes with the `plot` extra."""
