"""Regenerates the pictures of the guides, docs/images/*.png, with the project's own commands: the default run's
curves (`trillion train`, then `trillion plot`), the planner's trade-off and scaling (`trillion plan --plot`), the
mesh of one layout (`trillion plot --mesh`), one measured pipeline schedule (a profiled two-process run, then
`trillion plot`) and the fault-tolerance timeline of the kill/rejoin run (its test, then `trillion plot` on the run
directory it leaves). About ten minutes on two CPU cores, most of it the default run.

    python experiments/docs/pictures.py                        # every picture
    python experiments/docs/pictures.py --only mesh,pipeline   # some of them
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
TRILLION = [sys.executable, "-m", "trillion"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
KILL_REJOIN = (
    "tests/fault_tolerance/test_kill_rejoin.py::test_a_killed_group_leaves_the_other_training_and_rejoins_live_bitwise"
)
MESH = ["--world-size", "16", "--model.name=debug-moe", "--training.micro_batch_size=2"]
MESH += ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.tp=2", "--parallel.ep=4"]
PIPELINE = ["--parallel.pp=2", "--parallel.pp_schedule=1F1B", "--training.global_batch_size=16"]
PIPELINE += ["--training.micro_batch_size=2", "--training.steps=4", "--profiling.enabled=true", "--profiling.wait=2"]
PIPELINE += ["--profiling.warmup=1", "--profiling.active=1", "--eval.interval=0", "--checkpoint.interval=0"]


def run(command: list, work: Path) -> None:
    print("$", " ".join(map(str, command)), flush=True)
    env = {**os.environ, "WANDB_MODE": "offline"}
    subprocess.run(list(map(str, command)), cwd=work, env=env, check=True)


def default_run(work: Path) -> list[Path]:
    run([*TRILLION, "train", "--training.steps=200", f"--job.output_dir={work / 'default'}"], work)
    run([*TRILLION, "plot", work / "default"], work)
    return [work / "default" / "plots" / "curves.png"]


def plan(work: Path) -> list[Path]:
    flags = ["--model", "gpt-175b", "--hardware", "frontier", "--gpus", "1024", "--global-batch", "640"]
    run([*TRILLION, "plan", *flags, "--plot", work / "plan"], work)
    return [work / "plan" / "tradeoff.png", work / "plan" / "scaling.png"]


def mesh(work: Path) -> list[Path]:
    run([*TRILLION, "plot", "--mesh", *MESH, "--out", work / "mesh"], work)
    return [work / "mesh" / "mesh.png"]


def pipeline(work: Path) -> list[Path]:
    run(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "trillion", "train", *PIPELINE, f"--job.output_dir={work / 'pp'}"],
        work,
    )
    run([*TRILLION, "plot", work / "pp"], work)
    return [work / "pp" / "plots" / "pipeline.png"]


def fault_tolerance(work: Path) -> list[Path]:
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", KILL_REJOIN, "--basetemp", work / "ft"], ROOT)
    # the test's job.output_dir (replica_0/, replica_1/), in its numbered tmp_path; pytest links a *current name too
    (run_dir,) = [path for path in (work / "ft").glob("*/ft") if not path.parent.is_symlink()]
    run([*TRILLION, "plot", run_dir], work)
    return [run_dir / "plots" / "replica_groups.png"]


# name -> (the step, the images it writes into docs/images, in the order the step returns them)
PICTURES = {
    "default": (default_run, ("default-run.png",)),
    "plan": (plan, ("plan-tradeoff.png", "plan-scaling.png")),
    "mesh": (mesh, ("mesh.png",)),
    "pipeline": (pipeline, ("pipeline.png",)),
    "fault-tolerance": (fault_tolerance, ("fault-tolerance.png",)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PICTURES), help=f"some of {', '.join(PICTURES)}")
    chosen = parser.parse_args().only.split(",")
    unknown = sorted(set(chosen) - set(PICTURES))
    if unknown:
        parser.error(f"unknown picture(s) {', '.join(unknown)}; choose from {', '.join(PICTURES)}")
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trillion-pictures-") as folder:
        for name in chosen:
            step, images = PICTURES[name]
            for image, made in zip(images, step(Path(folder)), strict=True):
                shutil.copyfile(made, IMAGES / image)
                print(f"wrote {IMAGES / image}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
