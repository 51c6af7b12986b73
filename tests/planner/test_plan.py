"""The planner end to end: the Frontier table, the search, the CLI's outputs and its errors."""

import gc
import json
import time
from pathlib import Path

import pytest

from experiments.frontier.report import PAPER_RUNS
from trillion.devices import DEVICES, lookup_device
from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile, profile_names
from trillion.parallel.planner.search import Request, evaluate, metrics, search
from trillion.trainer.cli.main import main as trillion
from trillion.trainer.config.schema import load_config

JSON_KEYS = {
    "tp",
    "pp",
    "dp_replicate",
    "dp_shard",
    "dp_shard_mode",
    "pp_schedule",
    "micro_batch_size",
    "microbatches",
    "activation_checkpoint",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "hfu",
    "memory_gb",
}


def test_profiles_ship_and_feed_the_mfu_table():
    assert {"frontier", "dgx-a100", "dgx-h100", "dgx-h200", "mi300x"} <= set(profile_names())
    assert lookup_device("AMD Instinct MI250X").peak_tflops_bf16 == 191.5
    assert lookup_device("NVIDIA GH200 480GB").name == "gh200" and lookup_device("Intel Arc") is None
    assert load_profile("dgx-h100").device is DEVICES["h100"]


def test_user_profile_folder(tmp_path, monkeypatch):
    shipped = Path(load_profile("frontier").source).read_text()
    (tmp_path / "mine.toml").write_text(shipped.replace("gpus_per_node = 8", "gpus_per_node = 4"))
    monkeypatch.setenv("TRILLION_HARDWARE_PATH", str(tmp_path))
    assert "mine" in profile_names() and load_profile("mine").gpus_per_node == 4


def test_search_beats_the_papers_layout_and_fixed_flags_evaluate_one():
    model, gpus, batch, layout, _ = PAPER_RUNS[2]
    request = Request(model, get_preset(model), load_profile("frontier"), gpus, batch, 2048)
    paper = evaluate(request, layout)
    assert search(request).ranked[0].step.total < paper.step.total
    fixed = Request(
        model,
        get_preset(model),
        load_profile("frontier"),
        gpus,
        batch,
        2048,
        fixed={
            k: getattr(layout, k)
            for k in (
                "tp",
                "pp",
                "dp_replicate",
                "dp_shard",
                "dp_shard_mode",
                "pp_schedule",
                "micro_batch_size",
                "activation_checkpoint",
                "tp_overlap",
            )
        },
    )
    result = search(fixed)
    assert result.considered == 1 and result.ranked[0].step.total == paper.step.total


def test_schedules_order_bubbles_and_memory():
    request = Request("gpt-175b", get_preset("gpt-175b"), load_profile("frontier"), 128, 64, 2048)

    def run(schedule, v):
        return evaluate(
            request,
            Layout(
                tp=4,
                pp=16,
                dp_shard=2,
                dp_shard_mode="zero1",
                pp_schedule=schedule,
                virtual_stages=v,
                microbatches=32,
                activation_checkpoint="full",
            ),
        )

    one, interleaved, zbv, gpipe = run("1F1B", 1), run("Interleaved1F1B", 2), run("ZBVZeroBubble", 2), run("GPipe", 1)
    assert zbv.step.bubble < interleaved.step.bubble < one.step.bubble == gpipe.step.bubble
    assert one.step.bubble / one.step.total == pytest.approx(15 / (32 + 15), rel=0.15)
    assert gpipe.memory.activations > one.memory.activations  # all 32 micro-batches in flight, not 16


def test_pipeline_stages_cost_zero1_whatever_the_mode():
    """A pipeline schedule defers gradient sync to the last micro-batch and keeps its stages
    gathered (measured by trillion estimate against gloo runs); without one, zero3 saves memory."""
    request = Request("gpt-175b", get_preset("gpt-175b"), load_profile("frontier"), 128, 64, 2048)

    def memory(pp, mode, schedule="1F1B", v=1):
        return evaluate(
            request,
            Layout(
                tp=4,
                pp=pp,
                dp_shard=32 // pp,
                dp_shard_mode=mode,
                pp_schedule=schedule,
                virtual_stages=v,
                microbatches=64 // (32 // pp),
                activation_checkpoint="full",
            ),
        ).memory

    for schedule, v in (("1F1B", 1), ("ZBVZeroBubble", 2)):
        assert memory(8, "zero3", schedule, v).parameters == memory(8, "zero1", schedule, v).parameters
        assert memory(8, "zero3", schedule, v).gradients == memory(8, "zero1", schedule, v).gradients
    assert memory(1, "zero3").parameters < memory(1, "zero1").parameters


def test_thirty_thousand_gpus_in_seconds():
    # the search's own CPU seconds (6.2-7.2 here alone; bounded at about twice that): its thread's, not the wall
    # clock, which other jobs on the machine stretch, nor the process's, to which the threads earlier tests leave
    # behind add (10.6 s in a CI run); the suite's objects frozen out of the garbage collector's passes
    gc.collect()
    gc.freeze()
    try:
        start = time.thread_time()
        request = Request("gpt-1t", get_preset("gpt-1t"), load_profile("dgx-h100"), 30720, 15360, 2048, 20e12)
        assert search(request).ranked
        assert time.thread_time() - start < 15
    finally:
        gc.unfreeze()


def test_cli_json_and_train_config(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert (
        trillion(
            [
                "plan",
                "--model",
                "gpt-22b",
                "--hardware",
                "frontier",
                "--gpus",
                "16",
                "--global-batch",
                "640",
                "--tokens",
                "1e12",
                "--format",
                "json",
                "--top",
                "3",
                "--config-out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    best = report["candidates"][0]
    assert JSON_KEYS <= set(best) and {"time_to_train_days", "gpu_hours", "energy_mwh", "cost_usd"} <= set(best)
    config = load_config(str(out))
    assert (config.parallel.tp, config.parallel.pp, config.parallel.dp_shard, config.training.micro_batch_size) == (
        best["tp"],
        best["pp"],
        best["dp_shard"],
        best["micro_batch_size"],
    )


def test_cli_table_and_plots(tmp_path, capsys):
    assert (
        trillion(
            [
                "plan",
                "--model",
                "gpt-1.4b",
                "--hardware",
                "dgx-h100",
                "--gpus",
                "16",
                "--global-batch",
                "64",
                "--top",
                "2",
                "--config-out",
                "",
                "--plot",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "tokens/s" in capsys.readouterr().out
    assert (tmp_path / "tradeoff.png").stat().st_size > 0 and (tmp_path / "scaling.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "gpt-22b", "--hardware", "frontier", "--gpus", "100000", "--global-batch", "64"], "at most"),
        (
            ["--model", "gpt-22b", "--hardware", "frontier", "--gpus", "16", "--global-batch", "5", "--dp-shard", "2"],
            "global batch",
        ),
        (["--model", "gpt-1t", "--hardware", "frontier", "--gpus", "8", "--global-batch", "8"], "fits in memory"),
        (["--model", "gpt-22b", "--hardware", "tpu-v9", "--gpus", "16", "--global-batch", "64"], "frontier"),
        (["--model", "gpt-9t", "--hardware", "frontier", "--gpus", "16", "--global-batch", "64"], "gpt-1t"),
        (
            [
                "--model",
                "gpt-22b",
                "--hardware",
                "frontier",
                "--gpus",
                "16",
                "--global-batch",
                "64",
                "--pp-schedule",
                "X",
            ],
            "1F1B",
        ),
    ],
)
def test_invalid_requests_are_one_paragraph_errors(argv, message, capsys):
    assert trillion(["plan", *argv, "--config-out", ""]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_hfu_counts_the_recompute_each_stage_does():
    """Each stage module checkpoints every second of its own blocks: with one layer per stage (or
    per virtual stage) selective recomputes every layer, so HFU counts all of them, not half."""
    from trillion.parallel.planner.search import recompute_fraction

    args = get_preset("gpt-1t")  # 128 layers

    def fraction(pp, schedule="1F1B", v=1):
        return recompute_fraction(
            args,
            Layout(
                tp=4,
                pp=pp,
                dp_shard_mode="zero1",
                pp_schedule=schedule,
                virtual_stages=v,
                microbatches=2 * pp,
                activation_checkpoint="selective",
            ),
        )

    assert fraction(1) == 0.5 and fraction(64) == 0.5
    assert fraction(128) == 1.0 and fraction(64, "Interleaved1F1B", 2) == 1.0
    request = Request("gpt-1t", args, load_profile("frontier"), 1024, 1024, 2048)
    row = metrics(
        request,
        evaluate(
            request,
            Layout(
                tp=4, pp=128, dp_shard=2, dp_shard_mode="zero1", microbatches=512, activation_checkpoint="selective"
            ),
        ),
    )
    full = metrics(
        request,
        evaluate(
            request,
            Layout(tp=4, pp=128, dp_shard=2, dp_shard_mode="zero1", microbatches=512, activation_checkpoint="full"),
        ),
    )
    assert row["hfu"] == pytest.approx(full["hfu"])  # same work, same step time


@pytest.mark.parametrize(("schedule", "v"), [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2)])
def test_pipeline_bubble_is_p_minus_1_idle_slots_exactly(schedule, v):
    """The textbook bubble share (p-1)/(v m + p-1) of the slowest rank's step, exactly: a 15%
    tolerance on the whole step would hide p idle slots instead of p-1."""
    request = Request("gpt-175b", get_preset("gpt-175b"), load_profile("frontier"), 128, 64, 2048)
    p, m = 16, 32
    step = evaluate(
        request,
        Layout(
            tp=4,
            pp=p,
            dp_shard=2,
            dp_shard_mode="zero1",
            pp_schedule=schedule,
            virtual_stages=v,
            microbatches=m,
            activation_checkpoint="full",
        ),
    ).step
    busy = step.compute + step.imbalance + step.tp_exposed  # m micro-batches of the slowest rank
    assert step.bubble / (step.bubble + busy) == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


def test_trainer_hfu_counts_the_recompute_each_stage_does():
    """The trainer's HFU under pipelining: its stage split (embedding and output count as units: at
    128 stages the first and last hold none, two middle ones two) recomputes the first block of
    every stage under selective: 126 of 128 blocks, not the whole model's half."""
    from trillion.parallel.modes import recompute_fraction, stages_recompute_fraction
    from trillion.parallel.pipeline import split_units

    n_layers = 128
    blocks = [sum(1 for unit in r if 1 <= unit <= n_layers) for r in split_units(n_layers, 128)]
    assert (blocks.count(0), blocks.count(2), sum(blocks)) == (2, 2, n_layers)
    assert stages_recompute_fraction("selective", blocks) == 126 / 128
    assert stages_recompute_fraction("selective", [n_layers]) == recompute_fraction("selective", n_layers) == 0.5
    assert stages_recompute_fraction("selective:op", blocks) == 0.0
