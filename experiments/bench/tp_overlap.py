"""Latency injection: how much of tensor parallelism's collectives the chunked overlap (parallel.tp_overlap) hides,
measured on gloo ranks.

Every sequence-parallel all-gather and reduce-scatter of a training step is made to complete late, as on a wire of
fixed bandwidth whose transfer starts once every rank has posted: a collective of the whole stream (a micro-batch's
batch x seq x dim activation) completes D later than it would have, one chunk of it D / chunks later, each after the
one before it is through. With the overlap off they are DTensor's (`all_gather_single`, `reduce_scatter_single`,
held D after they complete); with it on, the overlap's own (parallel/tp_overlap.py TpCollectives.delay_s, its
bookkeeping on in the steps without delay too, so that its cost is not read as exposure), and DTensor's for what the
overlap leaves to it (the embedding's). A sleep, so the delay costs no CPU. Exposed: the step time with D minus
without, both in the same round (the median over the rounds); hidden = 1 - exposed(on) / exposed(off).

D is a multiple (--scales) of a GEMM's time, timed on the rank at the sublayer's local shapes. With `--delays gemm`
each collective's own: the GEMM it feeds or follows, forward and backward alike (an attention's all-gather: q, k, v,
and the reduce-scatter of their input gradient; its reduce-scatter: wo, and the all-gather of wo's output gradient;
the MLP's: w1 and w3, w2; the head's: the output projection; the embedding, beside no GEMM, the mean of a block's
four); a step's hooks set it as each sublayer's forward starts and as its output's gradient arrives. With `--delays
mean` every collective takes that mean: the same bytes cross the wire each time, so a slower wire is one D for all,
which the attention's collectives outlast their GEMMs by (wo's is about a third of the mean here). The debug model
widened (dim 512, FFN 1408, 4 layers), tp over all the ranks, 4 x 256 tokens a micro-batch, 2 micro-batches a step,
fp32. The settings (overlap off / on, D 0 / D) take turns step by step (the machine's other load falls on all
alike), medians after a warm-up round. Without --smoke the table is written into experiments/bench/RESULTS.md (its
section replaced).

    python experiments/bench/tp_overlap.py [--ranks 2] [--chunks 2,4] [--steps 5] [--scales 1] [--delays gemm,mean]
    python experiments/bench/tp_overlap.py --smoke         # tiny, seconds (tested)
    python experiments/bench/tp_overlap.py --device cuda   # device_check.sh: tp 2 on two GPUs, no injection

On GPUs (--device cuda, two or more of them): `trillion train` on llama3-1b at tp 2 (torchrun, NCCL, bf16, compiled)
with TP's collectives exposed, with the chunked overlap and with async TP, tokens/s each (the median of its logged
steps after the first five); with fewer GPUs one row says why nothing was measured.
"""

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.bench.results_file import replace_section  # noqa: E402
from experiments.bench.timing import in_turns, median_difference  # noqa: E402
from trillion.models import PRESETS, Transformer  # noqa: E402
from trillion.parallel.dims import ParallelDims  # noqa: E402
from trillion.parallel.forward_backward import MicroBatchLoop  # noqa: E402
from trillion.parallel.layout import Layout  # noqa: E402
from trillion.parallel.parallelize import parallelize  # noqa: E402
from trillion.parallel.tp_overlap import collectives  # noqa: E402
from trillion.trainer.step import train_step  # noqa: E402

HEADING = "## CPU: `python experiments/bench/tp_overlap.py`"
DELAYS = {"gemm": "its own GEMM", "mean": "the mean of a block's four GEMMs"}  # --delays


def model_args(smoke: bool):
    base = PRESETS["debug"]
    if smoke:
        return dataclasses.replace(base, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    return dataclasses.replace(base, n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1408)


KINDS = ("all_gather", "reduce_scatter")
READINGS = ("step", "blocked", "late")  # a step's seconds, its waits' blocked seconds, the delay they left uncovered


class LateDTensor:
    """DTensor's all-gathers and reduce-scatters held `delay_s[kind]` after they complete (DTensor waits for each
    before the next op, so that is when a wire that slow would deliver it); the seconds held in `blocked_s` and
    `late_s`."""

    def __init__(self):
        self.delay_s, self.blocked_s, self.late_s, self.calls = dict.fromkeys(KINDS, 0.0), 0.0, 0.0, 0
        for kind in KINDS:
            setattr(funcol, f"{kind}_single", self._late(getattr(funcol, f"{kind}_single"), kind))

    def _late(self, collective, kind: str):
        def late(*args, **kwargs):
            start = time.perf_counter()
            out = collective(*args, **kwargs)
            self.calls += 1
            if self.delay_s[kind] > 0:
                out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
                time.sleep(self.delay_s[kind])  # DTensor waits for it right away: all of it is the next op's
                self.late_s += self.delay_s[kind]
                self.blocked_s += time.perf_counter() - start
            return out

        return late


class DelaysBeside:
    """Sets every TP collective's injected delay to `scale` x the local GEMM beside it (the module docstring), as a
    step reaches each sublayer: on entering its forward, and when its output's gradient arrives (its backward).
    Forward, a sublayer's all-gather feeds its column GEMMs and its reduce-scatter follows its row GEMM; backward, the
    output gradient's all-gather feeds the row GEMM's input gradient and the input gradient's reduce-scatter follows
    the column GEMMs'."""

    def __init__(self, gemm: dict[str, tuple[float, float]], sinks: list):
        self.gemm, self.sinks, self.scale = gemm, sinks, 0.0

    def watch(self, model) -> None:
        sublayers = [("embedding", model.tok_embeddings), ("head", model.output)]
        for block in model.layers.values():
            sublayers += [("attention", block.attention), ("mlp", block.feed_forward)]
        for name, module in sublayers:  # before the pre-hooks that parallelize() put there post the all-gather
            module.register_forward_pre_hook(lambda *_, name=name: self._reach(name, forward=True), prepend=True)
            module.register_forward_hook(lambda _m, _a, out, name=name: self._on_gradient(name, out))

    def _on_gradient(self, name: str, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda _grad: self._reach(name, forward=False))

    def _reach(self, name: str, forward: bool) -> None:
        column, row = self.gemm[name]
        gather, scatter = (column, row) if forward else (row, column)
        for sink in self.sinks:
            sink.delay_s.update(all_gather=self.scale * gather, reduce_scatter=self.scale * scatter)


class Run:
    """The model twice on the tp group, DTensor TP and the chunked overlap, from the same weights; a step of either
    timed under any delay."""

    def __init__(self, args, world: int, chunks: int, batch: tuple, late: LateDTensor, gemm: dict):
        self.models = {}
        for overlap in (False, True):
            dims = ParallelDims(Layout(tp=world, tp_overlap=chunks if overlap else 0), world)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                model = parallelize(Transformer(args), dims)
            model.to_empty(device="cpu").init_weights(0)  # the same weights for both
            self.models[overlap] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), dims)
        self.comms = collectives(self.models[True][0])
        for comm in self.comms:  # the steps without delay pay the injection's bookkeeping too, so it is no exposure
            comm.instrumented = True
        self.delays = DelaysBeside(gemm, [late, *self.comms])
        for model, _, _ in self.models.values():
            self.delays.watch(model)
        self.args, self.batch, self.late = args, batch, late
        self.generator = torch.Generator().manual_seed(0)

    def step(self, overlap: bool, scale: float) -> dict:
        """A step's readings under delays `scale` x the GEMMs: its seconds, the seconds its waits blocked, the
        injected delay they left uncovered."""
        model, optimizer, dims = self.models[overlap]
        self.delays.scale = scale
        micro, seq, count = self.batch
        windows = torch.randint(0, self.args.vocab_size, (count, micro, seq + 1), generator=self.generator)
        blocked, late, calls = self._waits(), self._late(), self.late.calls
        dist.barrier()
        start = time.perf_counter()
        train_step(
            MicroBatchLoop(model, dims.layout),
            [(w[:, :-1], w[:, 1:]) for w in windows],
            optimizer,
            torch.amp.GradScaler("cpu", enabled=False),
            contextlib.nullcontext(),
            1.0,
            dims=dims,
        )
        seconds = time.perf_counter() - start
        if not overlap:
            self.dtensor_collectives = self.late.calls - calls  # a step's, all DTensor's with the overlap off
        return {"step": seconds, "blocked": self._waits() - blocked, "late": self._late() - late}

    def _waits(self) -> float:
        return self.late.blocked_s + sum(c.blocked_s for c in self.comms)

    def _late(self) -> float:
        return self.late.late_s + sum(c.late_s for c in self.comms)


def measure(run: Run, settings: list[tuple], rounds: int) -> dict:
    """Each reading (step, blocked, late) of each (overlap, delay) setting over the rounds, in round order
    (timing.in_turns)."""
    by_setting = in_turns(run.step, settings, rounds)
    return {name: {k: [r[name] for r in v] for k, v in by_setting.items()} for name in READINGS}


def gemm_seconds(args, tp: int, tokens: int) -> dict[str, tuple[float, float]]:
    """Per sublayer, (column, row) seconds of the local GEMMs beside its collectives, timed on the rank; the head is
    one column linear (its row figure unused); the embedding, beside no GEMM, takes the mean of the block's four."""
    h, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden
    shapes = {
        "attention": ([(h, q // tp), (h, kv // tp), (h, kv // tp)], [(q // tp, h)]),
        "mlp": ([(h, f // tp), (h, f // tp)], [(f // tp, h)]),
        "head": ([(h, args.vocab_size // tp)], [(h, args.vocab_size // tp)]),
    }
    seconds = {name: tuple(_timed(group, tokens) for group in groups) for name, groups in shapes.items()}
    block = [t for name in ("attention", "mlp") for t in seconds[name]]
    seconds["embedding"] = (statistics.mean(block),) * 2
    return seconds


def _timed(group: list[tuple[int, int]], tokens: int) -> float:
    """The median seconds of `tokens` rows through the GEMMs of `group`'s (k, n) weights, after two warm-ups."""
    operands = [(torch.randn(tokens, k), torch.randn(k, n)) for k, n in group]
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for x, w in operands:
            x @ w
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[2:])


def _rank(rank: int, world: int, store: str, ns, out: str) -> None:
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-4)  # the thread that notes a delayed collective's completion gets the GIL promptly
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    batch = (2, 32, 2) if ns.smoke else (4, 256, 2)  # micro-batch, sequence, micro-batches per step
    args, late_dtensor = model_args(ns.smoke), LateDTensor()
    measured = [gemm_seconds(args, world, batch[0] * batch[1])]
    dist.broadcast_object_list(measured, src=0)  # rank 0's times: one wire, the same delays on every rank
    beside = measured[0]
    mean = statistics.mean(t for name in ("attention", "mlp") for t in beside[name])
    gemms = {"gemm": beside, "mean": {name: (mean, mean) for name in beside}}
    rows = []
    for chunks in ns.chunks:
        run = Run(args, world, chunks, batch, late_dtensor, beside)
        for (delays, gemm), scale in itertools.product([(d, gemms[d]) for d in ns.delays], ns.scales):
            run.delays.gemm = gemm
            readings = measure(run, [(False, 0.0), (True, 0.0), (False, scale), (True, scale)], ns.steps)
            timed, waits, left = ({k: statistics.median(v) for k, v in readings[n].items()} for n in READINGS)
            step = readings["step"]  # exposed: the step's lengthening by the delay, paired within each round
            exposed = {o: median_difference(step[o, scale], step[o, 0.0]) for o in (False, True)}
            row = {
                "tp": world,
                "chunks": chunks,
                "delays": delays,
                "scale": scale,
                "gemm_ms": {name: [1e3 * t for t in pair] for name, pair in gemm.items()},
                "collectives_per_step": run.dtensor_collectives,
                "step_s": timed[False, 0.0],
                "step_overlap_s": timed[True, 0.0],
                "exposed_off_s": exposed[False],
                "exposed_on_s": exposed[True],
                "hidden": _hidden(exposed[True], exposed[False]),
                "blocked_off_s": waits[False, scale],
                "blocked_on_s": waits[True, scale],
                "hidden_by_waits": _hidden(waits[True, scale], waits[False, scale]),
                "late_off_s": left[False, scale],
                "late_on_s": left[True, scale],
                "hidden_by_delay_left": _hidden(left[True, scale], left[False, scale]),
            }
            rows.append(row)
            if rank == 0:  # each row as soon as it is measured, then all of them for the table
                print(json.dumps(row), flush=True)
                Path(out).write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    dist.destroy_process_group()


def _hidden(on: float, off: float) -> float:
    """The share of what is exposed without the overlap that it hides (nan where nothing was exposed)."""
    return 1 - on / off if off > 0 else float("nan")


def table(rows: list[dict]) -> str:
    lines = [
        "| tp | chunks | each collective's delay | collectives a step, their delays | step s off / on "
        "| exposed s, off / on | hidden | blocked in waits s, off / on | hidden by the waits | delay left s, off / on "
        "| hidden of the delay |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['chunks']} | {r['scale']:g} x {DELAYS[r['delays']]} | "
            f"{r['collectives_per_step']}, {r['late_off_s']:.3f} s | "
            f"{r['step_s']:.3f} / {r['step_overlap_s']:.3f} | {r['exposed_off_s']:.3f} / {r['exposed_on_s']:.3f} | "
            f"{r['hidden']:.0%} | {r['blocked_off_s']:.3f} / {r['blocked_on_s']:.3f} | {r['hidden_by_waits']:.0%} | "
            f"{r['late_off_s']:.3f} / {r['late_on_s']:.3f} | {r['hidden_by_delay_left']:.0%} |"
        )
    return "\n".join(lines)


def write_section(path: Path, rows: list[dict], ns) -> None:
    """This benchmark's section of RESULTS.md, replaced (or appended) with the table just measured."""
    load = os.getloadavg()[0]
    section = (
        f"{HEADING} (latency injection: how much of TP's collectives the chunked overlap hides)\n\n"
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, `python experiments/bench/tp_overlap.py --ranks {ns.ranks} "
        f"--chunks {','.join(map(str, ns.chunks))} --steps {ns.steps} --scales {','.join(map(str, ns.scales))} "
        f"--delays {','.join(ns.delays)}`, "
        f"{os.cpu_count()} CPU cores (1-minute load {load:.1f} at the end), torch {torch.__version__}, gloo, one "
        'thread a rank, fp32. The module docstring says what is measured. "exposed": how much the delay lengthens a '
        'step, the median over the rounds of the difference within each round. "collectives a step": DTensor\'s '
        "all-gathers and reduce-scatters in a step with the overlap off, and what they would expose if none hid "
        '(x the delay); "blocked": the seconds rank 0 spent in the delayed waits; "delay left": the part of them '
        "past each collective's own completion, the injected delay nothing covered, which the machine's other load "
        "(the ranks' drift, which the waits also hold) disturbs least.\n\n" + table(rows) + "\n"
    )
    replace_section(HEADING, section, path)


GPU_SETTINGS = {"exposed": (), "tp_overlap 4": ("--parallel.tp_overlap=4",), "async TP": ("--parallel.async_tp=true",)}


def gpu_rows(out: Path, steps: int = 25) -> list[dict]:
    """tp 2 on two GPUs with each of GPU_SETTINGS (the trainer's own tokens/s), or one row saying why not."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return [{"setting": "tp 2", "skipped": f"needs two GPUs; this machine has {gpus}"}]
    rows = []
    for name, settings in GPU_SETTINGS.items():
        run = out / name.replace(" ", "_")
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trillion"),
            *(
                "train",
                f"--job.output_dir={run}",
                "--model.name=llama3-1b",
                "--parallel.tp=2",
                "--compile.enabled=true",
            ),
            *(f"--training.steps={steps}", "--training.seq_len=2048", "--training.global_batch_size=8"),
            *(
                "--metrics.log_freq=1",
                "--checkpoint.interval=0",
                "--eval.interval=0",
                "--logging.wandb=false",
                *settings,
            ),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode:
            rows.append({"setting": name, "error": done.stderr.strip().splitlines()[-1][:300]})
            continue
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > 5]
        rows.append({"setting": name, "tokens_per_s": statistics.median(rates)})
    base = rows[0].get("tokens_per_s")
    for row in rows:
        if base and "tokens_per_s" in row:
            row["speedup"] = row["tokens_per_s"] / base
    return rows


def gpu_table(rows: list[dict]) -> str:
    lines = ["| tp 2 on two GPUs, llama3-1b | tokens/s | speed-up |", "|---|---|---|"]
    for r in rows:
        figure = r.get("skipped") or r.get("error") or f"{r['tokens_per_s']:,.0f} | {r['speedup']:.3f}"
        lines.append(f"| {r['setting']} | {figure} |" + (" |" if "tokens_per_s" not in r else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="gloo processes; tp over all of them")
    p.add_argument("--chunks", default="2,4", help="parallel.tp_overlap values to measure")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--scales", default="1", help="delays as multiples of the GEMM beside a collective")
    p.add_argument(
        "--delays",
        default="gemm,mean",
        help=f"which GEMM's time each collective's delay is ({'; '.join(f'{k}: {v}' for k, v in DELAYS.items())})",
    )
    p.add_argument("--out", default="experiments/bench/results")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ns = p.parse_args(argv)
    if ns.device == "cuda":
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        rows = gpu_rows(Path(ns.out))
        (Path(ns.out) / "tp_overlap_gpu.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (Path(ns.out) / "tp_overlap_gpu.md").write_text(
            "## tp 2: TP's collectives exposed, chunked, async\n\n" + gpu_table(rows) + "\n"
        )
        print(gpu_table(rows))
        return 0
    ns.chunks, ns.scales = [int(c) for c in ns.chunks.split(",")], [float(s) for s in ns.scales.split(",")]
    ns.delays = ns.delays.split(",")
    if ns.smoke:
        ns.steps, ns.scales, ns.chunks, ns.delays = 1, [1.0], [2], ["gemm"]
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    out = str(Path(ns.out) / "tp_overlap.jsonl")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(ns.ranks, f"{folder}/store", ns, out), nprocs=ns.ranks, join=True)
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    print(table(rows))
    if not ns.smoke:
        write_section(ROOT / "experiments/bench/RESULTS.md", rows, ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
