"""Read the records of an offline W&B run (.wandb file: W&B's LevelDB-style log of protobufs),
so tests check what the run holds rather than that a file exists."""

import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, LAST = 1, 4


def read_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B datastore file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + HEADER]) if left >= HEADER else (0, 0)
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run(output_dir: Path, timeout_s: float = 30.0) -> dict:
    """history rows, run config keys, group, tags and id of the offline run(s) under output_dir.

    wandb.finish() can return before W&B's service process has written the last records, so
    wait until every file ends with its exit record.
    """
    import json
    import time

    files = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) >= 1, f"no offline W&B run under {output_dir}"
    deadline = time.monotonic() + timeout_s
    while not all(any(r.WhichOneof("record_type") == "exit" for r in read_records(f)) for f in files):
        assert time.monotonic() < deadline, "the W&B run was never closed"
        time.sleep(0.2)
    run = {"history": [], "config": {}, "group": None, "tags": [], "id": None}
    for path in sorted(files):
        for record in read_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run["history"].append(
                    {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                )
            elif kind == "run":
                run["group"], run["tags"], run["id"] = record.run.run_group, list(record.run.tags), record.run.run_id
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return run
