"""W&B: what an offline run holds, an unreachable server, and one run continued after a restart."""

from pathlib import Path

from tests.helpers.wandb_records import offline_run
from trillion.trainer.config.schema import Logging
from trillion.trainer.metrics.meters import MetricsSink


def write_steps(output_dir: Path, cfg: Logging, steps, resume=False):
    sink = MetricsSink(output_dir, cfg, {"config": {"model": {"name": "debug"}}}, resume=resume)
    for step in steps:
        sink.write({"step": step, "loss": 10.0 / step, "mfu": None})
    sink.close()


def test_unreachable_server_falls_back_to_an_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    cfg = Logging(wandb_project="trillion-test", wandb_group="study", wandb_tags="a, b", wandb_init_timeout_s=3)
    write_steps(tmp_path, cfg, [1, 2, 3])
    run = offline_run(tmp_path)
    assert [row["loss"] for row in run["history"]] == [10.0, 5.0, 10.0 / 3]
    assert run["config"]["config"]["model"]["name"] == "debug"
    assert run["group"] == "study" and run["tags"] == ["a", "b"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_restart_continues_the_same_run(tmp_path):
    write_steps(tmp_path, Logging(), [1, 2])
    first_id = (tmp_path / "wandb_run_id").read_text()
    write_steps(tmp_path, Logging(), [3, 4], resume=True)
    assert (tmp_path / "wandb_run_id").read_text() == first_id
    # offline-run-<time>-<id>, with "-1" appended when the two starts fall in the same second
    runs = {p.name.split("-")[3] for p in (tmp_path / "wandb").glob("offline-run-*")}
    assert runs == {first_id}
    assert [r["_step"] for r in offline_run(tmp_path)["history"]] == [1, 2, 3, 4]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
