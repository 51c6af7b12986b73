"""`trillion estimate` as a user meets it: the table, JSON, a layout that does not fit, refusals."""

import json

import pytest

from tests.helpers.flags import DEBUG_SMALL, with_flags, without
from trillion.trainer.cli.main import main

DEBUG_2D = ["--config", "experiments/configs/debug_2d_cpu.toml"]  # world_size 4: dp_shard 2 x tp 2
SMALL = [*DEBUG_2D, *DEBUG_SMALL]


def _tiny_device(tmp_path, gb: float) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(f"""device = {{ name = "tiny", peak_tflops = {{ bf16 = 1.0 }}, memory_gb = {gb} }}
gpus_per_node = 8
intra_node = [{{ group = 8, bandwidth_gbs = 50 }}]
node_bandwidth_gbs = 100
""")
    return str(path)


def test_table_and_json_agree(capsys):
    assert main(["estimate", *SMALL, "--world-size", "4", "--ranks", "first,last", "--hardware", "frontier"]) == 0
    table = capsys.readouterr().out
    assert "dp_shard=1,tp=1" in table and "planner" in table and "yes" in table
    assert (
        main(["estimate", *SMALL, "--ranks", "all", "--format", "json", "--hardware", "frontier"]) == 0
    )  # world from the comment
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert all(r["fits"] and r["activations_source"] == "measured" for r in data["ranks"])
    assert data["error"] is None


def test_layout_that_does_not_fit_names_rank_shortfall_and_fix(tmp_path, capsys):
    code = main(["estimate", *SMALL, "--world-size", "4", "--hardware", _tiny_device(tmp_path, 0.01)])
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 0 (dp_shard 0, tp 0) of 4 needs" in err and "short by" in err
    assert "Activations dominate" in err and "--parallel.activation_checkpoint=full" in err


PIPELINE = [
    *SMALL,
    "--world-size",
    "4",
    "--parallel.pp=2",
    "--parallel.tp=1",
    "--parallel.dp_shard=2",
    "--training.global_batch_size=256",
    "--training.micro_batch_size=1",
]  # 128 micro-batches per pipeline


def test_pipeline_stages_that_do_not_fit_name_the_stage_and_what_to_change(tmp_path, capsys):
    device = _tiny_device(tmp_path, 0.02)
    assert main(["estimate", *PIPELINE, "--hardware", device, "--format", "json"]) == 1
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert [(r["rank"], r["stage"]) for r in data["ranks"]] == [(0, 0), (2, 1), (3, 1)]  # first, middle = max, last
    hidden = 64 * 256 * 4  # one micro-batch's fp32 hidden state (debug: dim 256)
    for_the_step = data["layout"]["pp_receive_buffers"] == "step"  # else held in flight, with the activations
    assert [r["detail"]["pipeline_receive"] for r in data["ranks"]] == [128 * hidden * for_the_step] * 3
    assert "rank 0 (pp 0, dp_shard 0) of 4 needs" in out.err and "Buffers dominate" in out.err
    assert ("the pipeline's receive buffers" if for_the_step else "keeps the rank's stages gathered") in out.err
    assert main(["estimate", *PIPELINE, "--hardware", device, "--parallel.pp_schedule=GPipe"]) == 1
    err = capsys.readouterr().err
    assert "Activations dominate" in err and "--parallel.pp_schedule=1F1B (now GPipe keeps all 128 micro-batches" in err


def test_a_stage_with_more_than_its_share_of_layers_gets_stage_sizes_that_even_them_out(tmp_path, capsys):
    """debug's 4 layers on 4 stages: the automatic split (embedding and output count as a layer each)
    gives E | 2 | 2 | O; the advice sizes them E+1 | 1 | 1 | 1+O, which the trainer accepts."""
    layout = [
        *without(SMALL, "--model.n_layers"),
        "--world-size",
        "4",
        "--parallel.pp=4",
        "--parallel.tp=1",
        "--parallel.dp_shard=1",
        "--training.global_batch_size=8",
        "--training.micro_batch_size=1",
        "--hardware",
        _tiny_device(tmp_path, 0.02),
    ]
    assert main(["estimate", *layout]) == 1
    err = capsys.readouterr().err
    even = "--parallel.pp_layers_per_stage=1 --parallel.pp_first_stage_layers=1 --parallel.pp_last_stage_layers=1"
    assert (
        "rank 1 (pp 1) of 4" in err and f"this rank's stage holds 2 layers where an even split gives 1: {even}" in err
    )
    assert main(["estimate", *layout, *even.split(), "--ranks", "all", "--format", "json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert [units for units in data["layout"]["stage_units"]] == [[0, 2], [2, 3], [3, 4], [4, 6]]


def test_refusals_are_one_paragraph(capsys):
    assert main(["estimate", *PIPELINE, "--parallel.pp_schedule=2F2B"]) == 2  # the pipeline's own check
    assert "parallel.pp_schedule='2F2B' is not known" in capsys.readouterr().err
    assert main(["estimate", *SMALL, "--world-size", "6"]) == 2
    assert "world size is 6" in capsys.readouterr().err
    assert main(["estimate", *SMALL, "--world-size", "4", "--ranks", "first,9"]) == 2
    assert "--ranks" in capsys.readouterr().err


NO_STAGE_SIZES = [
    "--parallel.pp_layers_per_stage=0",
    "--parallel.pp_first_stage_layers=-1",
    "--parallel.pp_last_stage_layers=-1",
]  # the shipped 1T config sizes its pipeline stages


@pytest.mark.slow
def test_gpt_1t_on_3072_ranks_fits_a_mi250x_gcd_under_zero3(capsys):
    """dp_shard 384 x tp 8, zero3, full checkpointing: under a minute, and it fits 64 GB."""
    import time

    start = time.perf_counter()
    code = main(
        [
            "estimate",
            "--config",
            "experiments/configs/gpt_1t_frontier.toml",
            "--world-size",
            "3072",
            "--parallel.pp=1",
            "--parallel.tp=8",
            "--parallel.dp_shard=384",
            "--parallel.dp_shard_mode=zero3",
            *NO_STAGE_SIZES,
            "--training.global_batch_size=1536",
            "--hardware",
            "frontier",
            "--format",
            "json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and time.perf_counter() - start < 90
    first = data["ranks"][0]
    assert first["parameter_count"] * 3072 > 1e12 and first["total"] < 64e9
    # the planner's prediction of the model states is the estimate's to 1%
    for kind in ("parameters", "gradients", "optimizer"):
        assert first[kind] == pytest.approx(first["planner"][kind], rel=0.01)


def test_steps_run_the_training_loop_as_the_first_and_last_rank(capsys):
    """dp_shard 2 x tp 2 with a vocabulary split unevenly over dp_shard (129 rows per tp rank): the last
    rank, simulated after the first in the same process, shards it its own way. The steps run without
    evaluation and W&B, so their settings (given here) are left out of the steps' config, not refused."""
    assert (
        main(
            [
                "estimate",
                "--config",
                "experiments/configs/debug_2d_cpu.toml",
                "--job.device=cpu",
                "--eval.steps=4",
                "--logging.wandb_project=trillion-estimate",
                "--steps",
                "2",
                "--format",
                "json",
            ]
        )
        == 0
    )
    runs = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["rank"], r["steps"], r["stopped"], r["failed"]) for r in runs] == [
        (0, 2, None, None),
        (3, 2, None, None),
    ]


def test_steps_with_a_pipeline_stop_at_the_schedule_and_say_why(capsys):
    assert main(["estimate", *PIPELINE, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "as rank 0: stopped before its first step: the pipeline schedule cannot step on the fake backend" in out
    assert "as rank 3: stopped before its first step" in out


@pytest.mark.slow
def test_paper_1t_layout_every_rank_in_under_a_minute(capsys):
    """The paper's gpt-1t layout (tp 4 x pp 128 x dp_shard 2) at its 1024 ranks: all simulated, and
    together they hold the model exactly once (norms replicated over tp aside)."""
    import time

    from trillion.models.flops import count_params
    from trillion.models.presets import get_preset

    start = time.perf_counter()
    main(
        [
            "estimate",
            "--config",
            "experiments/configs/gpt_1t_frontier.toml",
            "--hardware",
            "frontier",
            "--ranks",
            "all",
            "--format",
            "json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert time.perf_counter() - start < 60
    assert [r["rank"] for r in data["ranks"]] == list(range(1024))
    assert {r["stage"] for r in data["ranks"]} == set(range(128))
    held = sum(r["parameter_count"] for r in data["ranks"])
    assert held == pytest.approx(count_params(get_preset("gpt-1t")).total, rel=1e-3)


def test_context_parallelism_divides_each_ranks_activations(tmp_path, capsys):
    """A long-sequence layout: each of cp ranks holds 1/cp of every sequence, and so of its activations
    (measured, at equal world size), and the advice for activations that do not fit names cp. The excess
    over 1/cp is the block's gathered K/V, a sizeable term only in a model this small (K/V half as wide
    as the hidden state, a 320-token vocabulary): llama3-8b at 131072 tokens measures 1/cp exactly."""
    long = [
        *with_flags(SMALL, "--training.seq_len=1024"),
        "--world-size",
        "4",
        "--parallel.tp=1",
        "--ranks",
        "first",
        "--parallel.activation_checkpoint=full",
        "--training.global_batch_size=4",
        "--training.micro_batch_size=1",
    ]
    peaks = {}
    for cp in (1, 4):
        assert main(["estimate", *long, f"--parallel.cp={cp}", f"--parallel.dp_shard={4 // cp}", "--format=json"]) == 0
        (rank,) = json.loads(capsys.readouterr().out)["ranks"]
        assert rank["activations_source"] == "measured"
        peaks[cp] = rank["activations"]
    assert 1 / 4 < peaks[4] / peaks[1] < 1.2 / 4, peaks
    assert main(["estimate", *long, "--parallel.dp_shard=4", "--hardware", _tiny_device(tmp_path, 0.01)]) == 1
    assert "a larger --parallel.cp (now 1" in capsys.readouterr().err


def test_tp_overlap_steps_at_a_chunk_count_the_tiny_sequence_divides_and_async_tp_is_sized_as_dtensor(capsys):
    """The tiny loop's 4 positions a rank take parallel.tp_overlap=8 as 4 chunks; async TP, a compile pass on CUDA's
    symmetric memory that neither runs here, is sized as DTensor TP (its placements), and the table says so."""
    overlap = [*SMALL, "--parallel.tp_overlap=8", "--steps", "1", "--ranks", "first", "--format", "json"]
    assert main(["estimate", *overlap]) == 0
    assert [(r["steps"], r["failed"]) for r in json.loads(capsys.readouterr().out)["steps"]] == [(1, None)]
    assert main(["estimate", *SMALL, "--parallel.async_tp=true", "--compile.enabled=true", "--no-measure"]) == 0
    assert "async TP: sized as DTensor TP" in capsys.readouterr().out


def test_a_float8_plan_for_a_gpu_estimates_with_hardware_and_steps(capsys):
    """A plan file for float8 GPUs (float8 on, not emulated: `trillion plan --float8 --config-out`) estimates here with
    --hardware (the goodput's step time reads the layout) and --steps (the tiny loop): both as the dry run does, float8
    emulated on this CPU, which has no float8 units."""
    float8 = [*DEBUG_2D, "--model.n_layers=2", "--training.seq_len=64", "--float8.enabled=true", "--ranks", "first"]
    float8 += ["--format", "json"]  # the job's device a GPU's, as a plan writes it (not --job.device=cpu)
    assert main(["estimate", *float8, "--hardware", "dgx-h100", "--steps", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["steps"], r["failed"]) for r in data["steps"]] == [(1, None)] and data["goodput"]
