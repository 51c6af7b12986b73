"""Evaluation: the loss on held-out text, under any parallel layout.

The evaluation set is fixed for the run: eval.steps x eval.batch_size windows of the held-out
documents (or of eval.path / eval.name), dealt over data.lanes lanes as training reads its own
(`data.dealt_windows`: document m to lane m mod L, windows taken from the lanes in turn), so the
set spans many documents rather than the first few. It is read once when the run starts, so every
evaluation sees the same tokens and the curve moves only because the model does. Like the
training batches, evaluation batch i holds the same windows whatever the layout and the
data-parallel ranks take disjoint slices of it; the loss is the mean over every target token,
summed in float64 over the ranks, so one process and any layout agree to rounding.

Under pipelining torch's forward-only schedule (`schedule.eval`) runs the micro-batches: no
backward, no gradient buffers. Under TP the loss runs vocabulary-parallel as in training. Documents are
masked as in training unless eval.document_mask says otherwise; positions restart at each document as
training's do (data.reset_positions).
"""

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from trillion.errors import ConfigError
from trillion.parallel.context_parallel import shard_batch
from trillion.parallel.forward_backward import map_tensors, model_inputs, target_tokens, token_loss
from trillion.parallel.tensor_parallel import loss_context
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.config.schema import Eval as EvalConfig
from trillion.trainer.data.documents import window_micro_batches
from trillion.trainer.data.held_out import is_held_out
from trillion.trainer.data.sources import HFDocuments, build_documents
from trillion.trainer.data.windows import dealt_windows_with_documents, token_documents

log = logging.getLogger("trillion")
# The held-out documents are read in the corpus order of this seed, not the run's, so runs with
# different seeds are evaluated on the same windows.
EVAL_ORDER_SEED = 0
BEST_FILE = "best_eval.json"


def eval_batch_size(cfg: EvalConfig, global_batch_size: int, dp_size: int, micro_batch_size: int, pp: int) -> int:
    """Sequences per evaluation batch, checked against the layout: a pipeline schedule runs a fixed
    number of micro-batches, so under pipelining an evaluation batch is a training batch."""
    size = cfg.batch_size or global_batch_size
    if pp > 1 and size != global_batch_size:
        raise ConfigError(
            f"eval.batch_size={cfg.batch_size} differs from training.global_batch_size={global_batch_size}; "
            "under pipelining the schedule runs the training batch's micro-batches, so use "
            "--eval.batch_size=0 (the training batch)."
        )
    if size % (dp_size * micro_batch_size):
        raise ConfigError(
            f"eval.batch_size={size} does not split into micro-batches of {micro_batch_size} sequences "
            f"over {dp_size} data-parallel ranks; use a multiple of {dp_size * micro_batch_size}."
        )
    return size


def eval_documents(cfg: EvalConfig, data: DataConfig):
    """(documents, keep): a separate set read whole, or the held-out share of the training documents."""
    if not (cfg.path or cfg.name):
        return build_documents(data, EVAL_ORDER_SEED), lambda text: is_held_out(text, cfg.held_out)
    source = dataclasses.replace(
        data, path=cfg.path, name=cfg.name, split=cfg.split or ("train" if cfg.path else "validation")
    )
    try:
        return HFDocuments(source), lambda text: True
    except ConfigError as error:  # the reader names the data.* settings it was given: here they are eval.*'s
        message = str(error)
        for key in ("path", "name", "split"):
            message = message.replace(f"data.{key}", f"eval.{key}")
        raise ConfigError(message) from None


def read_eval_windows(
    cfg: EvalConfig, data: DataConfig, tokenizer, seq_len: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation set: eval.steps batches of batch_size windows of seq_len + 1 tokens, or as many
    whole batches as the set holds (never a window twice), and their document ids."""
    count = cfg.steps * batch_size
    if data.prepared and not (cfg.path or cfg.name):  # prepare-data kept the held-out documents beside each store
        from trillion.trainer.data.prepared import read_held_out_windows

        windows, ids = read_held_out_windows(data, tokenizer, seq_len, count)
    else:
        documents, keep = eval_documents(cfg, data)
        token_docs = token_documents(documents, tokenizer, keep)
        windows, ids = dealt_windows_with_documents(token_docs, data.lanes, seq_len + 1, count)
    whole = len(windows) // batch_size * batch_size
    return windows[:whole], ids[:whole]


class Evaluator:
    """This rank's share of the fixed evaluation batches, the loss over them, and when to compute it."""

    def __init__(
        self,
        windows: torch.Tensor,
        batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        interval: int = 1,
        *,
        document_ids: torch.Tensor | None = None,
        mask: bool = False,
        reset: bool = False,
    ):
        """`document_ids`: the windows', for masking (`mask`) and restarting positions (`reset`)."""
        local = batch_size // dp_size
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        self.batches = [batch[mine].split(micro_batch_size) for batch in windows.split(batch_size)]
        if document_ids is None:  # windows without their documents: nothing to mask
            self.document_ids = [(None,) * len(batch) for batch in self.batches]
        else:
            self.document_ids = [ids[mine].split(micro_batch_size) for ids in document_ids.split(batch_size)]
        self.mask, self.reset = mask, reset
        self.device, self.interval, self.best = device, interval, None

    def keep_best(self, output_dir: Path, resumed_step: int) -> None:
        """On the logging rank: track the best eval loss in the run directory."""
        self.best = BestEval(output_dir, resumed_step)

    def due(self, step: int, last: bool) -> bool:
        """Every eval.interval steps and after the last step of the job."""
        return step % self.interval == 0 or last

    def run(self, step: int, model, dims, autocast, pipeline=None) -> dict:
        """evaluate(), with the best eval loss so far on the logging rank, logged."""
        result = self.evaluate(model, dims, autocast, pipeline)
        if self.best is not None:
            result.update(self.best.update(step, result["eval_loss"]))
        log.info(
            "eval at step %d: loss %.4f  ppl %.2f  (%d tokens)",
            step,
            result["eval_loss"],
            result["eval_ppl"],
            result["eval_tokens"],
        )
        return result

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    @torch.no_grad()
    def evaluate(self, model, dims, autocast, pipeline=None) -> dict:
        """eval_loss (mean over every target token of the set), eval_ppl and eval_tokens, the same on every rank."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch, ids in zip(self.batches, self.document_ids):
            micro_batches = [
                map_tensors(window_micro_batches(w, i, len(w), mask=self.mask, reset=self.reset)[0], self._to_device)
                for w, i in zip(batch, ids)
            ]
            micro_batches = shard_batch(micro_batches, dims.cp_mesh)  # this cp rank's share of every sequence
            tokens += target_tokens(micro_batches)
            if pipeline is not None:
                with autocast:
                    loss_sum += pipeline.evaluate(micro_batches)
                continue
            for micro_batch in micro_batches:
                inputs, labels = micro_batch
                with autocast:
                    logits = model(inputs, **model_inputs(micro_batch))
                with loss_context(dims.tp_enabled):
                    loss = token_loss(logits, labels, 1)
                loss_sum += loss.to_local() if dims.tp_enabled else loss
        reshard(model)
        dims.all_reduce_dp(loss_sum)
        dims.all_reduce_dp(tokens)
        eval_loss = (loss_sum / tokens).item()
        return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 700.0)), "eval_tokens": int(tokens.item())}


def reshard(model) -> None:
    """Without a backward, FSDP modules that keep parameters gathered after forward (zero1/zero2,
    the root) would hold them until the next step: give the memory back now."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class BestEval:
    """The lowest eval loss so far and its step, kept in <output_dir>/best_eval.json."""

    def __init__(self, output_dir: Path, resumed_step: int):
        self.path = output_dir / BEST_FILE
        best = json.loads(self.path.read_text()) if resumed_step and self.path.is_file() else None
        # a best found after the checkpoint the run resumes from belongs to steps that run again
        self.best = best if best and best["step"] <= resumed_step else None

    def update(self, step: int, eval_loss: float) -> dict:
        if self.best is None or eval_loss < self.best["eval_loss"]:
            self.best = {"step": step, "eval_loss": eval_loss}
            self.path.write_text(json.dumps(self.best) + "\n")
        return {"best_eval_loss": self.best["eval_loss"], "best_eval_step": self.best["step"]}


def build_evaluator(
    cfg: EvalConfig,
    data: DataConfig,
    tokenizer,
    dims,
    *,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    device: torch.device,
) -> Evaluator | None:
    """The run's evaluator, or None when eval.interval is 0."""
    if not cfg.interval:
        return None
    batch_size = eval_batch_size(cfg, global_batch_size, dims.dp_size, micro_batch_size, dims.pp)
    windows, ids = read_eval_windows(cfg, data, tokenizer, seq_len, batch_size)
    source = cfg.path or cfg.name or f"eval.held_out={cfg.held_out:g} of the documents"
    batches = len(windows) // batch_size
    if batches == 0:
        message = (
            f"{source} holds less than one evaluation batch ({batch_size} windows of {seq_len + 1} tokens)"
            f"; {'raise --eval.held_out' if not (cfg.path or cfg.name) else 'give a larger set'} or lower "
            "--eval.batch_size"
        )
        if cfg.path or cfg.name:  # a set the user named must be usable
            raise ConfigError(message + ".")
        log.warning("%s: no evaluation in this run (--eval.interval=0 silences this).", message)
        return None
    if batches < cfg.steps:
        log.info("the evaluation set holds %d of the eval.steps=%d batches: evaluating on those", batches, cfg.steps)
    log.info("evaluation every %d steps on %d windows of %d tokens (%s)", cfg.interval, len(windows), seq_len, source)
    mask, reset = cfg.masks_documents(data), data.reset_positions
    if mask:
        log.info("evaluation masks attention within each document (eval.document_mask=%s)", cfg.document_mask)
    return Evaluator(
        windows,
        batch_size,
        micro_batch_size,
        dims.dp_rank,
        dims.dp_size,
        device,
        cfg.interval,
        document_ids=ids,
        mask=mask,
        reset=reset,
    )
