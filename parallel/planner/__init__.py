"""The analytic planner: hardware profiles, layouts and their rules, memory and step-time models,
the layout search, calibration and plots. It reasons about layouts without building a model."""
