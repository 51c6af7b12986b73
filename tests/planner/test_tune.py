"""`trillion tune` measures real trial runs (torchrun, gloo) of the planner's candidates."""

import json

from trillion.trainer.cli.main import main


def test_tune_measures_candidates_and_writes_the_fastest(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nname = "debug"\nn_layers = 1\n[training]\nglobal_batch_size = 4\nmicro_batch_size = 2\n'
        "seq_len = 32\n[logging]\nwandb = false\n"
    )
    out = tmp_path / "tune"
    status = main(
        [
            "tune",
            "--config",
            str(config),
            "--nproc",
            "2",
            "--hardware",
            "dgx-h100",
            "--candidates",
            "2",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert status == 0, capsys.readouterr().err
    trials = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(trials) == 2 and all(t["tokens_per_s"] > 0 and "error" not in t for t in trials)
    assert {(t["dp_replicate"], t["dp_shard"], t["dp_shard_mode"]) for t in trials}.__len__() == 2
    fastest = max(trials, key=lambda t: t["tokens_per_s"])
    best = (out / "best.toml").read_text()
    assert f"dp_replicate = {fastest['dp_replicate']}" in best and f"dp_shard = {fastest['dp_shard']}" in best
    for trial_dir in out.glob("round0-trial*"):
        assert json.loads((trial_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
