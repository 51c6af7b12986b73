"""The planner against published runs (experiments/validation): errors per row, the fit, the report."""

import pytest

from experiments.validation.predictions import RUNS_FILE, evaluate_all, leave_source_out, load_runs, refit, run_args
from experiments.validation.validate import TOLERANCE, comparable, render
from tests.helpers.documentation import documentation_text
from trillion.devices import fitted_constants
from trillion.models.flops import count_params

# rows explained as outside TOLERANCE must still not drift further (the MoE row, -37.6%, moved from -28.5% when the
# Hopper `sustained` fit slowed its GEMMs as every Hopper row's: its reason in runs.toml says so)
OUTSIDE_BOUND = 0.40


@pytest.fixture(scope="module")
def records():
    return evaluate_all()


def test_every_published_row_is_within_tolerance_or_explained(records):
    """Fitted rows count with their leave-one-out error: the constant refitted without the row."""
    assert len(records) >= 11
    for r in records:
        error = r.get("loo_error", r["error"])
        if not comparable(r):  # a layout the trainer cannot express: reported apart, with its reason
            assert r["run"]["outside_reason"].strip(), r["run"]["id"]
        elif abs(r.get("charged_error", OUTSIDE_BOUND)) <= TOLERANCE:  # the cause, computed: with it charged, inside
            assert (abs(error) > TOLERANCE) == ("outside_reason" in r["run"]), r["run"]["id"]
        elif "outside_reason" in r["run"]:  # a charged part of the cause must bring the row closer, not past zero
            assert TOLERANCE < abs(error) <= OUTSIDE_BOUND, (r["run"]["id"], error)
            assert abs(r.get("charged_error", error)) <= abs(error), r["run"]["id"]
            assert r.get("charged_error", error) * error > 0, r["run"]["id"]
        else:
            assert abs(error) <= TOLERANCE, (r["run"]["id"], error)


def test_fitted_rows_are_marked_with_their_leave_one_out_error(records):
    fitted_ids = {i for e in fitted_constants() for i in e["fitted_to"]}
    assert fitted_ids == {r["run"]["id"] for r in records if "loo_error" in r}
    assert all(len(e["devices"]) >= 1 and e["field"] in ("gemm_plateau", "sustained") for e in fitted_constants())
    assert len({e["family"] for e in fitted_constants()}) == len(fitted_constants())  # one scalar per family


def test_a_fit_over_several_publishers_carries_to_each_left_out():
    """The Hopper scalar refitted without one publisher's rows (torchtitan, Trainy, Megatron) predicts those rows
    within the tolerance: the fit is a property of the hardware, not of one trainer's runs."""
    checked = 0
    for entry in fitted_constants():
        for source, value, errors in leave_source_out(entry):
            assert 0.5 < value <= 1.0, (entry["family"], source, value)
            for run_id, error in errors:
                checked += 1
                assert abs(error) <= TOLERANCE, (entry["family"], source, run_id, error)
    assert checked >= 9


def test_fitted_value_is_what_refitting_gives():
    runs = load_runs()
    for entry in fitted_constants():
        assert refit(entry, [r for r in runs if r["id"] in entry["fitted_to"]]) == pytest.approx(
            entry["value"], abs=1e-3
        )


def test_every_run_names_its_source_and_setup():
    for run in load_runs():
        assert {
            "id",
            "source",
            "model",
            "hardware",
            "gpus",
            "global_batch",
            "seq_len",
            "precision",
            "layout",
            "metric",
            "published",
        } <= set(run), run["id"]


def test_a_row_that_publishes_its_parameter_count_is_planned_at_that_count():
    """The model shape a row is planned with reproduces the publisher's own count (llm-foundry's NumParams): a wrong
    shape guess (biases, tied embeddings, positions) fails here rather than hiding in the row's error."""
    counted = [run for run in load_runs() if "published_params" in run]
    assert len(counted) >= 16
    for run in counted:
        assert count_params(run_args(run)).total == run["published_params"], run["id"]


def test_validation_md_is_what_the_script_writes(records):
    written = (RUNS_FILE.parent / "VALIDATION.md").read_text()
    assert written == render(records), "VALIDATION.md is stale: run python experiments/validation/validate.py"


def test_the_guide_states_what_the_validation_shows(records):
    """The planning guide quotes the worst error and the ranges it names."""
    from experiments.validation.validate import row_error, worst

    docs = documentation_text()
    _, run_id = worst(records)
    signed = next(r.get("loo_error", r["error"]) for r in records if r["run"]["id"] == run_id)
    assert f"{100 * signed:+.1f}% ({run_id})" in docs
    frontier = [abs(r.get("loo_error", r["error"])) for r in records if r["run"]["id"].startswith("frontier")]
    assert max(frontier) < 0.08 and "Frontier rows and scaling efficiencies are within 8%" in docs
    hopper = next(e for e in fitted_constants() if e["family"].startswith("Hopper"))
    one_out = [abs(r["loo_error"]) for r in records if r.get("fitted") is not None and r["fitted"] == hopper]
    by_source = [abs(e) for _, _, errors in leave_source_out(hopper) for _, e in errors]
    assert max(one_out) < 0.08 and max(by_source) < 0.08
    assert "Hopper rows are within 8% each left out of the fit, and within 8% with each publisher's rows" in docs
    ampere = next(e for e in fitted_constants() if e["family"].startswith("Ampere"))
    ampere_one_out = [abs(r["loo_error"]) for r in records if r.get("fitted") == ampere]
    assert len(ampere_one_out) >= 8 and max(ampere_one_out) < 0.11
    assert "A100 rows are within 11% each left out of the fit" in docs
    held_out = [r for r in records if r["run"]["id"].startswith("megatron2021")]
    one_t = next(r for r in held_out if r["run"]["id"] == "megatron2021-1t-3072gpu")
    assert f"1T GPT on 3,072 A100s at {100 * one_t['error']:+.1f}%" in docs
    assert max(abs(r["charged_error"]) for r in held_out) <= 0.15
    by_size = sorted(held_out, key=lambda r: r["run"]["gpus"])
    assert f"(+{100 * by_size[-2]['error']:.1f}% at 530B to +{100 * by_size[0]['error']:.1f}% at 1.7B)" in docs
    held_hopper = {r["run"]["id"]: r["error"] for r in records if r["run"]["id"].startswith("llmfoundry-h100")}
    inside = sum(abs(e) <= 0.15 for e in held_hopper.values())
    words = {5: "five", 6: "six", 7: "seven"}
    assert f"within 15% on {words[inside]} of {words[len(held_hopper)]}" in docs
    assert f"760M ({100 * held_hopper['llmfoundry-h100-760m-2048']:+.1f}%)" in docs
    assert f"13B rows without checkpointing ({100 * held_hopper['llmfoundry-h100-13b-2048']:+.1f}%)" in docs
    mi300x = {r["run"]["id"]: r["error"] for r in records if r["run"]["hardware"] == "mi300x"}
    fp8_2, fp8_4, bf16 = (mi300x[f"te79-mi300x-8b-{k}"] for k in ("fp8-bsz2", "fp8-bsz4", "bf16-compile"))
    assert f"(float8 {100 * fp8_2:+.1f}% and {100 * fp8_4:+.1f}%, bf16 {100 * bf16:+.1f}%" in docs
    assert max(abs(e) for e in mi300x.values()) <= 0.15 and "to about 15% on MI300X" in docs
    cdna3 = next(e for e in fitted_constants() if e["family"].startswith("CDNA3"))
    assert f"MI300X {cdna3['value']}" in docs
    moe = next(r for r in records if r["run"]["id"].startswith("automodel"))
    assert f"MoE run is {100 * moe['error']:+.1f}% as planned and {100 * moe['charged_error']:+.1f}% with" in docs
    qwen = {r["run"]["id"].split("-")[-2]: r for r in records if r["run"]["id"].startswith("megatron-qwen3")}
    fsdp, pipelined = qwen["fsdp"], qwen["pp8"]
    assert f"are {100 * fsdp['error']:+.1f}% (FSDP; {100 * fsdp['charged_error']:+.1f}% with DeepEP charged" in docs
    assert f"and {100 * pipelined['error']:+.1f}% (pipelined at one 4096-token micro-batch" in docs
    charged_error, charged_id = worst(records, charged=True)
    charged_signed = next(row_error(r, charged=True) for r in records if r["run"]["id"] == charged_id)
    assert f"{100 * charged_signed:+.1f}% ({charged_id})" in docs


def test_the_guide_states_the_blackwell_rows(records):
    """The guide quotes each published Blackwell row's error (and the charged one where its kernel is charged)."""
    docs = documentation_text()
    rows = {r["run"]["id"]: r for r in records if r["run"]["hardware"] in ("dgx-b200", "gb200-nvl72")}
    assert len(rows) == 8

    def quoted(run_id: str) -> str:
        return f"{100 * rows[run_id]['error']:+.1f}%"

    dsv3, scout = "torchtitan-dsv3-671b-256-b200", "torchtitan-llama4-scout-256-gb200"
    llama = "torchtitan-llama3-8b-4-gb200"
    deepep, scout_bf16 = rows[f"{dsv3}-deepep"]["charged_error"], rows[f"{scout}-bf16"]["charged_error"]
    quotes = [
        f"bf16 {quoted(dsv3 + '-bf16')}, DeepEP {quoted(dsv3 + '-deepep')} ({100 * deepep:+.1f}% with",
        f"DeepEP + MXFP8 experts {quoted(dsv3 + '-deepep-mxfp8')}",
        f"bf16 {quoted(scout + '-bf16')} ({100 * scout_bf16:+.1f}% charged), MXFP8 {quoted(scout + '-mxfp8')}",
        f"bf16 {quoted(llama + '-bf16')}, MXFP8 {quoted(llama + '-mxfp8')}, NVFP4 {quoted(llama + '-nvfp4')}",
    ]
    assert [quote for quote in quotes if quote not in docs] == []


def test_the_guide_states_the_recorded_cpu_check():
    import tomllib

    from experiments.validation.validate import CPU_FILE, CPU_TOLERANCE

    rows = {r["layout"]: r["predicted_s"] / r["measured_s"] - 1 for r in tomllib.loads(CPU_FILE.read_text())["row"]}
    docs = documentation_text()
    assert set(rows) == {"1 process", "dp_shard 2 (FSDP, gloo)", "tp 2 (gloo)"}
    text = " ".join(docs.split())
    assert all(abs(error) <= CPU_TOLERANCE for error in rows.values())  # the must-show, as recorded
    assert f"within 30% of the measured step ({100 * rows['1 process']:+.0f}%)" in text
    assert f"(dp_shard 2 {100 * rows['dp_shard 2 (FSDP, gloo)']:+.0f}%, tp 2 {100 * rows['tp 2 (gloo)']:+.0f}%)" in text
