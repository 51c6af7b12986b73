"""Per-step metrics (loss, grad norm, LR, tokens/s, TFLOP/s, MFU/HFU, memory, data wait) and
where they go: metrics.jsonl always, Weights & Biases and TensorBoard when enabled, the console."""

import errno
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trillion.devices import lookup_device
from trillion.errors import ConfigError, RunAborted
from trillion.trainer.config.schema import Logging as LoggingConfig

log = logging.getLogger("trillion")


def device_peak_flops(device: torch.device, configured_tflops: float) -> float | None:
    """Dense peak FLOP/s of one device: the configured figure, else the table; None if unknown."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cpu":
        log.warning("MFU is not reported on CPU (no peak FLOP/s is known); set --metrics.peak_tflops to get one.")
        return None
    name = torch.cuda.get_device_name(device)
    spec = lookup_device(name, torch.cuda.get_device_properties(device).multi_processor_count)
    if spec is None:
        log.warning(
            "MFU is not reported: device %r is not in the peak table (trillion/devices.toml), or names "
            "two parts its compute-unit count does not tell apart; set --metrics.peak_tflops.",
            name,
        )
        return None
    return spec.peak_tflops_bf16 * 1e12


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class ThroughputMeter:
    """Turns tokens and seconds of the steps since the last report into per-device rates. The FLOPs per token
    are functions of the attention share document masking leaves (models/flops.py), which each step reports."""

    def __init__(
        self,
        model_flops_per_token: Callable[[float], float],
        hardware_flops_per_token: Callable[[float], float],
        peak_flops: float | None,
    ):
        self.model_flops_per_token, self.hardware_flops_per_token = model_flops_per_token, hardware_flops_per_token
        self.peak = peak_flops
        self.reset()

    def reset(self) -> None:
        self.tokens, self.seconds, self.data_seconds, self.steps, self.shared = 0, 0.0, 0.0, 0, 0.0

    def add(self, tokens_per_device: int, step_seconds: float, data_seconds: float, attention_share=1.0) -> None:
        self.tokens += tokens_per_device
        self.shared += tokens_per_device * attention_share
        self.seconds += step_seconds
        self.data_seconds += data_seconds
        self.steps += 1

    def report(self) -> dict:
        tokens_per_s = self.tokens / max(self.seconds, 1e-9)
        share = self.shared / max(self.tokens, 1e-9)  # the FLOPs are linear in it: its token-weighted mean
        model_flops = tokens_per_s * self.model_flops_per_token(share)
        hardware_flops = tokens_per_s * self.hardware_flops_per_token(share)
        out = {
            "tokens_per_s": tokens_per_s,
            "tflops": model_flops / 1e12,
            "mfu": model_flops / self.peak if self.peak else None,
            "hfu": hardware_flops / self.peak if self.peak else None,
            "attention_share": share,  # the attention work document masking left (1.0: none masked)
            "step_time_s": self.seconds / max(self.steps, 1),
            "data_wait_s": self.data_seconds / max(self.steps, 1),
        }
        self.reset()
        return out


class MetricsSink:
    """metrics.jsonl, plus W&B and TensorBoard. Only the logging rank creates one."""

    def __init__(self, output_dir: Path, cfg: LoggingConfig, resolved_config: dict, resume: bool = False):
        # Unbuffered: a record reaches the file in `write` or not at all, so a failing disk is met there,
        # where the partial line can be cut off, and never again in a flush at close.
        self.path = output_dir / "metrics.jsonl"
        self.jsonl = open(self.path, "ab" if resume else "wb", buffering=0)
        self.wandb_run = _start_wandb(output_dir, cfg, resolved_config, resume) if cfg.wandb else None
        self.tensorboard = _start_tensorboard(output_dir) if cfg.tensorboard else None

    def write(self, record: dict) -> None:
        self._append_line((json.dumps(record) + "\n").encode())
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(numbers, step=record["step"])
            except Exception as error:  # a tracking outage must never stop training
                log.warning("W&B logging failed (%s); continuing with metrics.jsonl only.", error)
                self.wandb_run = None
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, record["step"])

    def _append_line(self, line: bytes) -> None:
        """The whole line, or nothing: on a write error the file is cut back to its last whole record."""
        end = self.jsonl.seek(0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:
                view = view[self.jsonl.write(view) :]
        except OSError as error:
            self.jsonl.truncate(end)
            raise metrics_write_error(error, self.path) from None

    def close(self) -> None:
        self.jsonl.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as error:
                log.warning("W&B run did not finish cleanly: %s", error)
        if self.tensorboard is not None:
            self.tensorboard.close()


def metrics_write_error(error: OSError, path: Path) -> RunAborted:
    """The one paragraph a failed metrics write ends the run with, as a failed checkpoint save does."""
    cause = "No space left on the device" if error.errno == errno.ENOSPC else f"{error.strerror or error}"
    return RunAborted(
        f"{cause} while writing {path}: the record was not written (the file ends at the one before it). "
        f"Checkpoints are untouched. Free space there or point --job.output_dir at a larger filesystem, then run "
        f"the same command again to resume from the newest checkpoint."
    )


def _start_wandb(output_dir: Path, cfg: LoggingConfig, resolved_config: dict, resume: bool):
    """Online when the user configured W&B (a project or an API key), offline otherwise.

    An unreachable server costs at most `wandb_init_timeout_s`, after which the run is written
    offline (for `wandb sync` later); training never waits on the network beyond that. The run id
    is kept in the run directory, so a restarted job continues the same W&B run.
    """
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed; set --logging.wandb=false to silence this.")
        return None
    online = bool(cfg.wandb_project or os.environ.get("WANDB_PROJECT") or os.environ.get("WANDB_API_KEY"))
    mode = os.environ.get("WANDB_MODE") or ("online" if online else "offline")
    id_file = output_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
    options = dict(
        project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "trillion",
        entity=cfg.wandb_entity or None,
        name=cfg.wandb_run_name or output_dir.name,
        group=cfg.wandb_group or None,
        tags=[t.strip() for t in cfg.wandb_tags.split(",") if t.strip()] or None,
        dir=str(output_dir),
        config=resolved_config,
        id=run_id,
        resume="allow" if run_id else None,
    )
    for attempt_mode in dict.fromkeys([mode, "offline"]):
        try:
            run = wandb.init(
                mode=attempt_mode,
                settings=wandb.Settings(init_timeout=cfg.wandb_init_timeout_s, silent=True, console="off"),
                **options,
            )
        except Exception as error:
            log.warning(
                "W&B did not start in %s mode (%s)%s",
                attempt_mode,
                str(error).splitlines()[0],
                "; writing the run offline instead." if attempt_mode != "offline" else "; metrics.jsonl only.",
            )
            continue
        id_file.write_text(run.id)
        return run
    return None


def _start_tensorboard(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or set --logging.tensorboard=false)."
        ) from None
    return SummaryWriter(str(output_dir / "tensorboard"))


class StepLog:
    """Which steps are logged, and where their records go (metrics.jsonl and trackers through the sink,
    the progress bar); the sink and bar exist on the logging rank only, None elsewhere.

    A step is planned for logging every metrics.log_freq steps, and at the job's first step and the
    schedule's last; it is logged if planned, if it ends the job or if it was evaluated."""

    def __init__(self, log_freq: int, first_step: int, total_steps: int, sink, progress):
        self.log_freq, self.first_step, self.total_steps = log_freq, first_step, total_steps
        self.sink, self.progress = sink, progress

    def planned(self, step: int) -> bool:
        return step % self.log_freq == 0 or step in (self.first_step, self.total_steps)

    def should_log(self, step: int, last: bool, evaluated: bool) -> bool:
        return self.planned(step) or last or evaluated

    def write(self, record: dict) -> None:
        if self.sink is not None:
            self.sink.write(record)
            self.progress.update(record["step"], record)

    def tick(self, step: int) -> None:
        """A step that was not logged moves the progress bar."""
        if self.progress is not None:
            self.progress.update(step, None)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.sink is not None:
            self.sink.close()


class Progress:
    """A live bar with loss, tokens/s and ETA on a terminal; plain log lines elsewhere (SLURM logs, CI)."""

    def __init__(self, total_steps: int, first_step: int, mode: str):
        self.total, self.start_step, self.start_time = total_steps, first_step, time.perf_counter()
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        if use_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total_steps, completed=first_step, status="")
            self.bar.start()

    def update(self, step: int, record: dict | None) -> None:
        if self.bar is not None:
            if record is not None:
                self.bar.update(self.task, status=_status(record))
            self.bar.update(self.task, completed=step)
        elif record is not None:
            elapsed = time.perf_counter() - self.start_time
            eta = elapsed / max(step - self.start_step, 1) * (self.total - step)
            log.info("step %d/%d  %s  eta %s", step, self.total, _status(record), _duration(eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _status(record: dict) -> str:
    """A training record, an evaluation record (step 0) or a training record with its evaluation."""
    text = ""
    if "loss" in record:
        text = f"loss {record['loss']:.4f}  grad {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s"
    if "mtp_loss" in record:  # multi-token prediction's own loss
        text += f"  mtp {record['mtp_loss']:.4f}"
    if record.get("mfu") is not None:
        text += f"  mfu {100 * record['mfu']:.1f}%"
    if "eval_loss" in record:
        text += f"  eval {record['eval_loss']:.4f}"
    if loads := [v for k, v in record.items() if k.startswith("moe/") and k.endswith("/max_mean")]:
        text += f"  experts max/mean {max(loads):.2f}"  # the worst layer's load against an even share
    if dropped := sum(v for k, v in record.items() if k.startswith("moe/") and k.endswith("/dropped")):
        text += f"  dropped {100 * dropped / len(loads):.1f}%"
    return text.strip()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
