"""A data corpus changed under a resumed run (files added, removed, edited) is detected from the
fingerprint saved in the checkpoint and refused, naming the files and the flag that accepts it."""

import json
import os

from tests.helpers.flags import TINY
from tests.helpers.runs import run
from trillion.trainer.cli.main import main


def write_docs(path, words):
    path.write_text("".join(json.dumps({"text": f"{word} " * 400}) + "\n" for word in words))


def test_changed_corpus_is_refused_with_the_flag_that_accepts_it(tmp_path, capsys):
    corpus, out = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    for name in ("a", "b"):
        write_docs(corpus / f"{name}.jsonl", [name, "common", "words"])
    run(out, f"--data.path={corpus}", "--training.exit_interval=2", steps=4)
    resume = ["train", *TINY, "--training.steps=4", f"--job.output_dir={out}", f"--data.path={corpus}"]

    write_docs(corpus / "c.jsonl", ["new"])  # added
    os.utime(corpus / "a.jsonl", ns=(1, 1))  # edited (touched)
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert "1 added (" in err and "c.jsonl" in err and "1 edited (" in err and "a.jsonl" in err
    assert "--checkpoint.accept_data_change=true" in err and "Traceback" not in err

    assert main([*resume, "--checkpoint.accept_data_change=true"]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
