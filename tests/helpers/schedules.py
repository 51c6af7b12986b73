"""The trainer's pipeline checks on bare settings, in the trainer's two steps (trainer/assemble.py): the schedule
resolved with its stages per rank (modes.check_schedule, as resolve_layout does), then the pipeline checked against
the model's layers (pipeline.validate_pipeline, as check_model_layout does)."""

from trillion.parallel.layout import AUTOMATIC_STAGES, Layout, StageLayers
from trillion.parallel.modes import check_schedule
from trillion.parallel.pipeline import validate_pipeline


def trainer_pipeline(
    pp: int,
    schedule: str,
    n_layers: int,
    microbatches: int,
    *,
    virtual: int = 0,
    compile: bool = False,
    tie_embeddings: bool = False,
    layers: StageLayers = AUTOMATIC_STAGES,
) -> tuple[str, int]:
    """(the schedule's name, stages per rank) the trainer runs, or its ConfigError."""
    resolved, stages = check_schedule(schedule, pp, microbatches, virtual, compile)
    layout = Layout(
        pp=pp,
        pp_schedule=resolved.name,
        virtual_stages=stages,
        microbatches=microbatches,
        compile=compile,
        stage_layers=layers,
    )
    validate_pipeline(layout, n_layers, tie_embeddings=tie_embeddings)
    return resolved.name, stages
