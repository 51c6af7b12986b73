"""Evaluation: the loss on held-out text, under any parallel layout."""
from trillion.errors import ConfigError
from trillion.trainer.config import Eval as EvalConfig


def validate_eval(cfg: EvalConfig) -> None:
    for name in ("interval", "steps", "batch_size"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"eval.{name}={getattr(cfg, name)} must be 0 or more.")
    if not 0.0 <= cfg.held_out < 1.0:
        raise ConfigError(f"eval.held_out={cfg.held_out} is a share of the documents: give a value in [0, 1), e.g. 0.01.")
    if cfg.path and cfg.name:
        raise ConfigError(f"eval.path={cfg.path!r} and eval.name={cfg.name!r} both name an evaluation set; keep one.")
    if cfg.interval and not cfg.steps:
        raise ConfigError(f"eval.interval={cfg.interval} evaluates on eval.steps=0 batches; give --eval.steps=16 "
                          "(or --eval.interval=0 to turn evaluation off).")
    if cfg.interval and not (cfg.path or cfg.name or cfg.held_out):
        raise ConfigError(f"eval.interval={cfg.interval} needs text to evaluate on: hold some documents out "
                          "(--eval.held_out=0.01) or give a separate set (--eval.path=FILE), or set --eval.interval=0.")
