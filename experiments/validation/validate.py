"""Writes experiments/validation/VALIDATION.md: the planner against published training runs.

  python experiments/validation/validate.py            # evaluate runs.toml, write VALIDATION.md
  python experiments/validation/validate.py --refit    # also print each fitted constant refitted

Every run of runs.toml is evaluated by the planner with the shipped hardware profiles; the rows
trillion/fitted.toml fitted a constant to are marked, with the error when that row is left out
of the fit (the constant refitted to the others). The CPU table comes from cpu_results.toml, which
cpu_check.py writes (calibrate, predict and measure in one run).
"""

import argparse
import sys
from pathlib import Path

import tomllib

from trillion.devices import fitted_constants

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script, the repository's modules
from experiments.validation.predictions import (  # noqa: E402
    HERE,
    evaluate_all,
    leave_source_out,
    load_pairs,
    load_runs,
    refit,
)

CPU_FILE = HERE / "cpu_results.toml"
TOLERANCE = 0.15  # published rows
CPU_TOLERANCE = 0.30
PAIR_TOLERANCE = 0.03  # a technique's published speed-up against the planner's, in points of the ratio


def _figure(metric: str, value: float) -> str:
    if metric == "model_tflops_per_gpu":
        return f"{value:.1f} TFLOP/s"
    return f"{value:,.0f}" if metric == "tokens_per_s_per_gpu" else f"{100 * value:.2f}%"


def _model(run: dict) -> str:
    shape = run.get("model_shape")
    if not shape:
        return run["model"]
    if not {"n_layers", "dim", "n_heads", "vocab_size"} <= set(shape):  # a setting changed, not the shape
        return f"{run['model']} with " + ", ".join(f"{key} {value}" for key, value in shape.items())
    return (
        f"{run['model']} as {shape['n_layers']} x {shape['dim']}, {shape['n_heads']} heads, vocab {shape['vocab_size']}"
    )


def _layout(spec: dict) -> str:
    dp = f"dp {spec['dp_replicate']}x{spec.get('dp_shard', 'n')} {spec['dp_shard_mode']}"
    return (
        f"tp {spec['tp']}, pp {spec['pp']}, {dp}, {spec['pp_schedule']}, mb {spec['micro_batch_size']}, "
        f"ckpt {spec['activation_checkpoint']}{', compile' if spec.get('compile') else ''}"
        f"{_float8(spec)}{_ep(spec)}"
    )


def _ep(spec: dict) -> str:
    dispatch = f" per {spec['ep_dispatch']}" if "ep_dispatch" in spec else ""
    folded = " folded over tp (etp 1)" if spec.get("etp") == 1 and spec["tp"] > 1 else ""
    return f", ep {spec['ep']}{folded}{dispatch}" if spec.get("ep", 1) > 1 else ""


def _float8(spec: dict) -> str:
    if not spec.get("float8"):
        return ""
    recipe = spec.get("float8_recipe", "tensorwise")
    if recipe != "tensorwise":  # another recipe: its name, and whether it leaves the linears out
        only = "" if spec.get("float8_linears", True) else " (experts only)"
        return f", {recipe}{only}" + (", float8 dispatch" if spec.get("float8_dispatch") else "")
    gather = " (float8 all-gather)" if spec.get("float8_all_gather", True) else ""
    experts = f", {spec['float8_experts']} float8 experts" if spec.get("float8_experts", "auto") != "auto" else ""
    cache = ", float8 activation cache" if spec.get("float8_cache_activations") else ""
    cache += ", float8 combine gradient" if spec.get("float8_combine_gradient") else ""
    return ", float8" + gather + experts + (", float8 dispatch" if spec.get("float8_dispatch") else "") + cache


def comparable(record: dict) -> bool:
    """False for a published layout Trillion's trainer cannot express (`expressible = false` in runs.toml, with its
    reason): reported beside the validation, not counted in it."""
    return record["run"].get("expressible", True)


def row_error(record: dict, charged: bool = False) -> float:
    """The row's error (leave-one-out for a fitted row); `charged`: with its system's own kernels charged."""
    if charged and "charged_error" in record:
        return record["charged_error"]
    return record.get("loo_error", record["error"])


def worst(records: list[dict], charged: bool = False) -> tuple[float, str]:
    """The largest error the planner makes on a row no constant was fitted to (leave-one-out for fitted rows)."""
    return max((abs(row_error(r, charged)), r["run"]["id"]) for r in records if comparable(r))


def cpu_section() -> list[str]:
    if not CPU_FILE.is_file():
        return [
            "## Predicted vs measured on this CPU",
            "",
            "Not measured yet: run `python experiments/validation/cpu_check.py`.",
            "",
        ]
    data = tomllib.loads(CPU_FILE.read_text())
    lines = [
        "## Predicted vs measured on a CPU (calibrate, predict, measure in one script)",
        "",
        f"`{data['command']}` on {data['machine']}, {data['date']}. {data['load']}",
        "",
        f"Calibrated profile: {data['profile_summary']}",
        "",
        f"| layout | processes | predicted s/step (median of {data['repeats']}) | measured s/step (median of "
        f"{data['repeats']}) | measured min-max | error | within ±{CPU_TOLERANCE:.0%} | error of each repeat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["row"]:
        error = row["predicted_s"] / row["measured_s"] - 1
        each = ", ".join(
            f"{100 * (p / m - 1):+.0f}%" for p, m in zip(row["predicted_by_repeat"], row["measured_by_repeat"])
        )
        lines.append(
            f"| {row['layout']} | {row['processes']} | {row['predicted_s']:.3f} | {row['measured_s']:.3f} "
            f"| {row['measured_min_s']:.3f}-{row['measured_max_s']:.3f} | {100 * error:+.1f}% "
            f"| {'yes' if abs(error) <= CPU_TOLERANCE else '**no**'} | {each} |"
        )
    return lines + ["", data.get("note", ""), "", " ".join(data.get("finding", "").split()), ""]


def render(records: list[dict]) -> str:
    worst_error, worst_id = worst(records)
    charged_error, charged_id = worst(records, charged=True)
    apart = [r for r in records if not comparable(r)]
    records = [r for r in records if comparable(r)]
    lines = [
        "# The planner against published training runs",
        "",
        "Generated by `python experiments/validation/validate.py` from `runs.toml` (each run's source, model, "
        "machine, layout, batch, sequence length, precision, checkpointing and published figure) with the shipped "
        "hardware profiles. Error = predicted / published - 1.",
        "",
        f"**Worst error on a row no constant was fitted to: {100 * worst_error:.1f}% ({worst_id})**; "
        f"rows within ±{TOLERANCE:.0%}: {sum(abs(row_error(r)) <= TOLERANCE for r in records)} "
        f"of {len(records)}. With the costs of the published systems' own kernels charged beside them (the unfused "
        f"attention of Megatron-LM of 2021, Megatron-Core's and NeMo Automodel's DeepEP dispatch and fused "
        f"permutation, torchtitan's bf16 torch._grouped_mm on Blackwell): worst "
        f"{100 * charged_error:.1f}% ({charged_id}), "
        f"{sum(abs(row_error(r, charged=True)) <= TOLERANCE for r in records)} of {len(records)} "
        f"within ±{TOLERANCE:.0%}.",
        "",
        (
            "| run | model | machine | layout | GPUs | batch x seq | published | predicted | error "
            "| fitted: leave-one-out error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        run = r["run"]
        gpus = " -> ".join(map(str, run["gpus"])) if isinstance(run["gpus"], list) else run["gpus"]
        fitted = (
            f"yes ({r['fitted']['field']} {r['loo_value']:.3f} without it): {100 * r['loo_error']:+.1f}%"
            + (f"; its cost {r['fitted_share']:.0%} of the step" if "fitted_share" in r else "")
            if "fitted" in r
            else "no"
        )
        lines.append(
            f"| {run['id']} | {_model(run)} | {run['hardware']} | {_layout(run['layout'])} | {gpus} "
            f"| {run['global_batch']} x {run['seq_len']} | {_figure(run['metric'], run['published'])} "
            f"| {_figure(run['metric'], r['predicted'])} | {100 * r['error']:+.1f}% | {fitted} |"
        )
    memory = [r for r in records if "published_memory_gib" in r["run"]]
    if memory:
        lines += [
            "",
            "Memory (not validated: the published figures are another trainer's allocator peaks):",
            "",
            "| run | published GiB | predicted GiB |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['run']['id']} | {r['run']['published_memory_gib']} | {r['row']['memory_gb'] * 1e9 / 2**30:.1f} |"
            for r in memory
        ]
    lines += fitted_section() + findings_section(records)
    outside = [r for r in records if abs(row_error(r)) > TOLERANCE]
    lines += ["", f"## Rows outside ±{TOLERANCE:.0%}", ""]
    reasons = {}
    for r in outside:  # rows sharing a reason are listed together
        reasons.setdefault(r["run"].get("outside_reason", "no reason found yet."), []).append(r)
    paragraphs = [
        ", ".join(f"**{r['run']['id']}** ({'; '.join([f'{100 * row_error(r):+.1f}%', *_charge(r)])})" for r in rows)
        + f": {' '.join(reason.split())}"
        for reason, rows in reasons.items()
    ]
    lines += ["\n\n".join(paragraphs) or "None."]  # one paragraph per reason
    lines += [""] + pairs_section(records) + inexpressible_section(apart) + cpu_section()
    return "\n".join(lines) + "\n"


def fitted_section() -> list[str]:
    """Each fitted constant: its value, rows, method and why; the parts it is carried to; each publisher left out."""
    lines = ["", "## Fitted constants", ""]
    for entry in fitted_constants():
        lines.append(
            f"- {entry['family']}: `{entry['field']}` = {entry['value']} ({', '.join(entry['devices'])}), fitted to "
            f"{', '.join(entry['fitted_to'])} by {entry['method']}. {' '.join(entry['why'].split())}"
        )
        if entry.get("carried_to"):
            lines.append(f"  - carried to {', '.join(entry['carried_to'])}: {entry['carried']}")
        for source, value, errors in leave_source_out(entry):
            lines.append(
                f"  - {source}'s rows left out ({entry['field']} {value:.3f} from the others): "
                + ", ".join(f"{i} {100 * e:+.1f}%" for i, e in errors)
            )
    return lines


def _charge(record: dict) -> list[str]:
    """The charge beside a row whose system's own kernels it is (none for the others)."""
    if "charge_share" not in record:
        return []
    return [
        f"{record['charge_name']} {100 * record['charge_share']:+.1f}% of the step, "
        f"with it {100 * record['charged_error']:+.1f}%"
    ]


def findings_section(records: list[dict]) -> list[str]:
    """What the decomposition of each row against the planner's terms found, one paragraph per finding."""
    found = {}
    for r in records:
        if "finding" in r["run"]:
            label = " ".join([f"**{r['run']['id']}**", *(f"({charge})" for charge in _charge(r))])
            found.setdefault(r["run"]["finding"], []).append(label)
    if not found:
        return []
    lines = ["", "## What the rows show (the planner's terms against the published step)", ""]
    return lines + ["\n\n".join(f"{', '.join(ids)}: {' '.join(t.split())}" for t, ids in found.items())]


def pairs_section(records: list[dict]) -> list[str]:
    """Each [[pair]]: the speed-up one technique gave a published layout (the run with it over the run without) and
    the planner's for the same two rows, within PAIR_TOLERANCE points or with what stays named."""
    pairs = load_pairs()
    if not pairs:
        return []
    by_id = {r["run"]["id"]: r for r in records}
    lines = [
        "## Pairs: what one technique gave a published layout, against the planner",
        "",
        "| technique | run with it | run without | published ratio | predicted ratio | points "
        f"| within ±{100 * PAIR_TOLERANCE:.0f} |",
        "|---|---|---|---|---|---|---|",
    ]
    reasons = {}
    for pair in pairs:
        on, off = by_id[pair["with"]], by_id[pair["without"]]
        published = on["run"]["published"] / off["run"]["published"]
        predicted = on["predicted"] / off["predicted"]
        inside = abs(predicted - published) <= PAIR_TOLERANCE
        lines.append(
            f"| {pair['what']} | {pair['with']} | {pair['without']} | {published:.3f} | {predicted:.3f} "
            f"| {100 * (predicted - published):+.1f} | {'yes' if inside else '**no**'} |"
        )
        reasons.setdefault(pair["reason"], []).append(pair["what"])
    lines += [""] + ["\n\n".join(f"{', '.join(whats)}: {' '.join(t.split())}" for t, whats in reasons.items())]
    return lines + [""]


def inexpressible_section(records: list[dict]) -> list[str]:
    """Published runs in layouts Trillion's trainer cannot express, planned at the nearest layout it can."""
    if not records:
        return []
    lines = [
        "## Published layouts the trainer cannot express (reported, not validated)",
        "",
        "Planned at the nearest layout Trillion runs; the error is that layout's prediction against the published "
        "run, not the planner's error on the run's own layout.",
        "",
        "| run | model | machine | planned as | GPUs | batch x seq | published | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        run = r["run"]
        lines.append(
            f"| {run['id']} | {_model(run)} | {run['hardware']} | {_layout(run['layout'])} | {run['gpus']} "
            f"| {run['global_batch']} x {run['seq_len']} | {_figure(run['metric'], run['published'])} "
            f"| {_figure(run['metric'], r['predicted'])} | {100 * r['error']:+.1f}% |"
        )
    reasons = {}
    for r in records:
        reasons.setdefault(r["run"]["outside_reason"], []).append(r["run"]["id"])
    lines += [""] + [
        "\n\n".join(f"{', '.join(f'**{i}**' for i in ids)}: {' '.join(t.split())}" for t, ids in reasons.items())
    ]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "VALIDATION.md"))
    parser.add_argument("--refit", action="store_true", help="print each fitted constant refitted to its rows")
    ns = parser.parse_args()
    if ns.refit:
        runs = load_runs()
        for entry in fitted_constants():
            value = refit(entry, [r for r in runs if r["id"] in entry["fitted_to"]])
            print(f"{entry['family']} {entry['field']}: fitted.toml {entry['value']}, refitted {value}")
    text = render(evaluate_all())
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
