"""The held-out loss is the same in one process, at dp_shard 2 x tp 2 (loss parallel), at cp 2 x dp_shard 2
(each rank a share of every sequence) and at pp 2 x dp_shard 2 (torch's forward-only schedule): the trainer
itself runs each layout on gloo, fp32, evaluating before the first step and after every step, and the
pipeline's evaluations run no backward."""

import json
import random
from pathlib import Path

import pytest

from tests.helpers.flags import QUIET, SMALL, with_flags
from tests.helpers.spawn import as_launched, run_ranks
from trillion.trainer.config.schema import load_config
from trillion.trainer.train import train

STEPS, EVAL_BATCHES = 2, 2
TINY = with_flags(
    SMALL,
    f"--training.steps={STEPS}",
    "--eval.interval=1",
    f"--eval.steps={EVAL_BATCHES}",
    "--eval.held_out=0.25",
    *QUIET,
)
LAYOUTS = {
    "2d": ["--parallel.dp_shard=2", "--parallel.tp=2"],
    "pp": ["--parallel.pp=2", "--parallel.dp_shard=2"],
    "cp": ["--parallel.cp=2", "--parallel.dp_shard=2"],
}


def _corpus(path: Path) -> Path:
    rng = random.Random(5)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "y", "(", ")", ":", "\n    "]
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 120)))}) + "\n" for _ in range(200))
    )
    return path


def _run(out: Path, corpus: Path, *layout: str) -> list[dict]:
    train(load_config(None, [*TINY, f"--data.path={corpus}", f"--job.output_dir={out}", *layout]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _forward_only_pipeline_evaluation() -> dict:
    """Checks every pipelined evaluation: no stage runs a backward, no gradient appears, and no
    receive buffer of a gradient is allocated."""
    from trillion.parallel.pipeline import Pipeline
    from trillion.parallel.pipeline_stage import InFlightReceiveStage

    evaluate, backward = Pipeline.evaluate, InFlightReceiveStage.backward_one_chunk
    seen = {"evaluating": False, "evaluations": 0}

    def checked_backward(self, *args, **kwargs):
        # torch's schedules still call backward_one_chunk under eval(), which returns at once without a backward
        assert not (seen["evaluating"] and self.has_backward), "a backward ran during evaluation"
        return backward(self, *args, **kwargs)

    def checked_evaluate(self, micro_batches):
        seen["evaluating"] = True
        try:
            loss = evaluate(self, micro_batches)
        finally:
            seen["evaluating"] = False
        assert not loss.requires_grad
        assert all(p.grad is None for part in self.parts for p in part.parameters()), "evaluation made gradients"
        assert all(
            info.buffer is None for stage in self.stages for infos in stage.grad_recv_info.values() for info in infos
        ), "a gradient receive buffer outlived the evaluation"
        seen["evaluations"] += 1
        return loss

    Pipeline.evaluate, InFlightReceiveStage.backward_one_chunk = checked_evaluate, checked_backward
    return seen


def _layouts(rank, world_size, root, corpus):
    as_launched(rank, world_size)
    _run(root / "2d", corpus, *LAYOUTS["2d"])
    _run(root / "cp", corpus, *LAYOUTS["cp"])
    seen = _forward_only_pipeline_evaluation()
    _run(root / "pp", corpus, *LAYOUTS["pp"])
    assert seen["evaluations"] == (STEPS + 1) * EVAL_BATCHES, seen


def test_held_out_loss_is_the_same_under_fsdp_tp_cp_and_pipelining(tmp_path):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    alone = _run(tmp_path / "one", corpus)
    run_ranks(_layouts, 4, tmp_path, corpus)
    expected = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in alone if "eval_loss" in r]
    assert [step for step, _, _ in expected] == list(range(STEPS + 1))
    assert expected[-1][1] < expected[0][1]  # the model learned: the later evaluations see other weights
    for name in LAYOUTS:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        got = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in records if "eval_loss" in r]
        assert [(s, n) for s, _, n in got] == [(s, n) for s, _, n in expected], name
        for (step, loss, _), (_, reference, _) in zip(got, expected):
            assert loss == pytest.approx(reference, rel=1e-5), (name, step)
        best = json.loads((tmp_path / name / "best_eval.json").read_text())
        assert best["step"] == STEPS and best["eval_loss"] == pytest.approx(expected[-1][1], rel=1e-5)
