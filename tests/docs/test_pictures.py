"""The guides' pictures: each is built here from small inputs by the command that makes it (`trillion plot` on a run
directory's records, `trillion plot --mesh` on a layout; the planner's `--plot` in tests/planner/test_plan.py), the
mesh holds the groups the documented rank order gives, and docs/images holds exactly the pictures that
experiments/docs/pictures.py writes, each shown by a guide."""

import importlib.util
import json
import sys
from pathlib import Path

from tests.helpers.documentation import DOCS, ROOT
from trillion.parallel.layout import Layout
from trillion.trainer.cli.main import main
from trillion.trainer.tools.plot.mesh import rank_groups
from trillion.trainer.tools.plot.run import gap_label

PNG = b"\x89PNG\r\n\x1a\n"


def picture_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file (its IHDR chunk)."""
    data = path.read_bytes()
    assert data.startswith(PNG), path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def write_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def training_records(steps: int, *, start: float = 0.0, groups=None) -> list[dict]:
    records = [{"step": 0, "eval_loss": 5.8, "time": start}]
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.8 - 0.3 * step, "tokens_per_s": 400.0 + step, "time": start + step}
        records.append(record if groups is None else {**record, "replica_groups": groups(step)})
        if step % 4 == 0:
            records.append({"step": step, "eval_loss": 5.8 - 0.25 * step, "time": start + step})
    return records


def test_a_run_directory_gives_its_curves_its_pipeline_schedule_and_its_replica_groups(tmp_path, capsys):
    run = tmp_path / "run"
    write_records(run / "metrics.jsonl", training_records(12))
    trace = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipeline rank 0"}}]
    for rank in (0, 1):
        for index, (action, micro_batch) in enumerate(
            [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)]
        ):
            args = {"stage": rank, "micro_batch": micro_batch}
            start = 1000 * (index + rank)
            trace.append(
                {
                    "ph": "X",
                    "name": f"{action} {micro_batch}",
                    "cat": action,
                    "pid": rank,
                    "ts": start,
                    "dur": 900,
                    "args": args,
                }
            )
    (run / "profiles").mkdir()
    (run / "profiles" / "pipeline-step2.json").write_text(json.dumps({"traceEvents": trace}))
    (run / "profiles" / "pipeline-step10.json").write_text(json.dumps({"traceEvents": trace}))
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.split() == [
        "wrote",
        str(run / "plots" / "curves.png"),
        "wrote",
        str(run / "plots" / "pipeline.png"),
    ]
    assert picture_size(run / "plots" / "curves.png") == (840, 720)
    assert picture_size(run / "plots" / "pipeline.png")[0] == 1080

    ft = tmp_path / "ft"  # a fault-tolerant run's job.output_dir: group 1 away for steps 5-8
    write_records(
        ft / "replica_0" / "metrics.jsonl", training_records(12, groups=lambda s: [0] if 5 <= s <= 8 else [0, 1])
    )
    group_1 = [r for r in training_records(12, groups=lambda s: [0, 1]) if not 5 <= r["step"] <= 8]
    write_records(ft / "replica_1" / "metrics.jsonl", group_1)
    assert main(["plot", str(ft), "--out", str(tmp_path / "pictures")]) == 0
    assert "replica_groups.png" in capsys.readouterr().out
    assert picture_size(tmp_path / "pictures" / "replica_groups.png") == (960, 456)
    assert not (tmp_path / "pictures" / "curves.png").exists()  # each group's curves: trillion plot ft/replica_0
    assert (gap_label(4, 9), gap_label(4, 5), gap_label(4, 6)) == ("away: steps 5-8", "paused", "away: step 5")


def test_the_mesh_holds_the_groups_of_the_documented_rank_order(tmp_path, capsys):
    # tp innermost, then dp_shard, pp outermost: rank = 4 pp + 2 dp_shard + tp
    groups = rank_groups(Layout(pp=2, dp_shard=2, tp=2), 8)
    assert groups == {
        "pp": [(0, 4), (1, 5), (2, 6), (3, 7)],
        "dp_shard": [(0, 2), (1, 3), (4, 6), (5, 7)],
        "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    }
    # ep carved out of dp_shard, innermost: each expert group is consecutive data-parallel ranks
    assert rank_groups(Layout(dp_shard=4, ep=2), 4) == {"dp_shard": [(0, 1, 2, 3)], "ep": [(0, 1), (2, 3)]}
    flags = ["--world-size", "8", "--model.name=debug-moe", "--parallel.dp_shard=4", "--parallel.tp=2"]
    assert main(["plot", "--mesh", *flags, "--parallel.ep=2", "--out", str(tmp_path)]) == 0
    assert "mesh.png" in capsys.readouterr().out and picture_size(tmp_path / "mesh.png")[0] > 400


def test_refusals_name_the_fix(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    write_records(tmp_path / "empty" / "metrics.jsonl", [])
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no logged step" in capsys.readouterr().err
    assert main(["plot", "--mesh"]) == 2
    assert "--world-size" in capsys.readouterr().err
    assert main(["plot"]) == 2
    assert "one of the two" in capsys.readouterr().err
    write_records(tmp_path / "run" / "metrics.jsonl", training_records(2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert "pip install 'trillion[plot]'" in capsys.readouterr().err


def test_docs_images_are_the_pictures_the_script_writes_and_the_guides_show_them():
    spec = importlib.util.spec_from_file_location("pictures", ROOT / "experiments/docs/pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    written = sorted(image for _, images in pictures.PICTURES.values() for image in images)
    assert sorted(p.name for p in (DOCS / "images").iterdir()) == written
    shown = " ".join(path.read_text() for path in DOCS.glob("*.md"))
    assert [image for image in written if f"(images/{image})" not in shown] == []
    assert all(picture_size(DOCS / "images" / image)[0] >= 600 for image in written)


def test_the_planners_scaling_plot_shows_an_efficiency_above_110_percent():
    from trillion.parallel.planner.plot import efficiency_top

    assert efficiency_top({"weak": [(128, 1.0), (256, 0.98)]}) == 110.0
    assert efficiency_top({"weak": [(384, 1.0), (3072, 1.36)]}) == 105.0 * 1.36
    assert efficiency_top({"strong": [(8, 1.0)]}, {"published": (16, 1.2)}) == 105.0 * 1.2
