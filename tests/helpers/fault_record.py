"""The fault matrix's record. Each fault test reports what the user sees, the completed steps that had
to run again, whether the final loss equals the unbroken run's bitwise and the time to recover;
`python experiments/reliability/report.py` runs those tests with TRILLION_FAULT_REPORT set and
writes experiments/reliability/REPORT.md from the records. Without the variable nothing is written."""

import json
import os
import re
from pathlib import Path


def report(
    fault: str, user_sees: str, steps_lost: int | None, loss_equal: bool | None, recover_s: float | None, how: str
) -> None:
    """`loss_equal` None: the run does not restart (or the fault changes training by design);
    `recover_s`: from the fault to the restarted run's first trained step (or to every rank's exit)."""
    folder = os.environ.get("TRILLION_FAULT_REPORT")
    if not folder:
        return
    user_sees = re.sub(r"/tmp/\S*?/(run|crashed)/", "<output_dir>/", user_sees)  # pytest's folders mean nothing there
    record = {
        "fault": fault,
        "user_sees": user_sees,
        "steps_lost": steps_lost,
        "loss_equal": loss_equal,
        "recover_s": recover_s,
        "how": how,
    }
    slug = "".join(c if c.isalnum() else "-" for c in fault.lower())
    (Path(folder) / f"{slug}.json").write_text(json.dumps(record, indent=1))


def first_step_time(metrics: Path, step: int) -> float:
    """Wall time of the last record of `step` in metrics.jsonl: the restarted run's, when it ran again."""
    times = [r["time"] for r in map(json.loads, metrics.read_text().splitlines()) if r["step"] == step]
    return times[-1]


def last_line(text: str, *needles: str) -> str:
    """The last log line holding all `needles`, without caplog's level and source: what the user reads."""
    lines = [line for line in text.splitlines() if all(n in line for n in needles)]
    return re.sub(r"^[A-Z]+\s+\S+:\S+:\d+\s+", "", lines[-1]).strip() if lines else ""
