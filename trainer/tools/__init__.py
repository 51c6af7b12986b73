"""Tools that run the trainer's own code: the full-scale dry run (`trillion estimate`, estimate/), the planner's
command line (`trillion plan`, plan_cli.py) and short measured trials of its best layouts (`trillion tune`)."""
