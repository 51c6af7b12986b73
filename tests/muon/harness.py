"""Muon parity harness: a tiny model trained 10 steps with optimizer.name=muon under a layout (FSDP's ZeRO modes,
HSDP, TP, CP, EP, PP and compositions; MuonClip with `qk_clip`) against one process, same seed, fp32, gloo.

Compared with the one-process run (rank 0): every loss and every parameter after the last step (full_tensor,
gathered by name across pipeline stages), at 1e-6 relative; and the matrices orthogonalized, summed over all
ranks, must be each hidden matrix once per step (the optimizers' own counts). Cases run the trainer's step
(trainer/step.py: clipping, gradient accumulation) and its optimizer (trainer/optim.py build_optimizer)."""

import contextlib
import os

import torch
import torch.distributed as dist

from tests.helpers.parity import FAMILIES, GLOBAL_BATCH, SEED, SEQ_LEN, RandomWindows, _full, case_layout
from tests.moe.harness import MODELS as MOE_MODELS
from trillion.models import Transformer
from trillion.models.logit_probe import install_probes
from trillion.models.transformer import _copy_full_into
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.muon.matrices import hidden_matrices
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.config.schema import Optimizer
from trillion.trainer.data.loader import DataLoader
from trillion.trainer.optim import build_optimizer
from trillion.trainer.step import train_step

MODELS = {"dense": FAMILIES["llama"], "moe": MOE_MODELS["gqa"], "mla": MOE_MODELS["mla"]}
STEPS, MICRO_BATCH, MAX_NORM, LR = 10, 2, 1.0, 5e-4
RTOL = 1e-6  # losses, and each parameter tensor: ||difference|| / ||parameter||


def optimizer_config(case: dict) -> Optimizer:
    return Optimizer(
        name="muon",
        lr=case.get("lr", LR),
        weight_decay=0.1,
        implementation="foreach",
        newton_schulz_dtype="float32",
        qk_clip=case.get("qk_clip", 0.0),
    )


def pump_first_head(parts, args, factor: float) -> None:
    """Head 0's query rows x `factor` in every layer: its logits grow past the others' (MuonClip's cases)."""
    for part in parts:
        for name, param in part.named_parameters():
            if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
                full = _full(param)
                full[: full.shape[0] // args.n_heads] *= factor
                with torch.no_grad():
                    _copy_full_into(param, full)


def _build(case: dict, dims: ParallelDims, args):
    """(runner, this rank's model parts)."""
    with torch.device("meta"):
        model = Transformer(args)
    if case.get("qk_clip"):
        assert not install_probes(model)
    if dims.pp == 1:
        parallelize(model, dims)
        model.to_empty(device="cpu")
        model.init_weights(SEED)
        pump_first_head([model], args, case.get("pump", 1.0))
        return MicroBatchLoop(model, dims.layout), [model]
    pipeline = Pipeline(model, dims, torch.device("cpu"), parallelize_fn=lambda part: parallelize(part, dims))
    for part in pipeline.parts:
        part.to_empty(device="cpu")
        part.init_weights(SEED)
    pump_first_head(pipeline.parts, args, case.get("pump", 1.0))
    pipeline.build()
    return pipeline, pipeline.parts


def train_case(case: dict, world_size: int) -> dict:
    args = MODELS[case.get("model", "dense")]
    dims = ParallelDims(case_layout(case, world_size), world_size)
    check_layout(dims.layout, args, SEQ_LEN)
    dims.build_mesh("cpu")
    runner, model_parts = _build(case, dims, args)
    initial = {n: _full(p) for part in model_parts for n, p in part.named_parameters()}
    optimizer = build_optimizer(runner.model, optimizer_config(case), "cpu", model_args=args, dims=dims)
    optimizer.orthogonalizer.round_elements = case.get("round_elements", optimizer.orthogonalizer.round_elements)
    loader = DataLoader(
        RandomWindows(args.vocab_size, SEQ_LEN + 1), GLOBAL_BATCH, MICRO_BATCH, dims.dp_rank, dims.dp_size
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses, maxima = [], []
    for _ in range(STEPS):
        loss, _ = train_step(
            runner, loader.next_batch(), optimizer, scaler, contextlib.nullcontext(), MAX_NORM, dims=dims
        )
        losses.append(loss.item())
        if optimizer.clip is not None:
            maxima.append([probe.step_max.clone() for probe, *_ in optimizer.clip.layers])
    params = {n: _full(p) for part in model_parts for n, p in part.named_parameters()}
    orthogonalized = torch.tensor(optimizer.orthogonalized)
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, params)
        params = {n: t for found in gathered for n, t in found.items()}
        dist.all_reduce(orthogonalized)
    return {
        "losses": losses,
        "params": params,
        "initial": initial,
        "orthogonalized": int(orthogonalized),
        "maxima": maxima,
    }


def matrices_per_step(model: str) -> int:
    return sum(m.count for m in hidden_matrices(MODELS[model]).values())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: a tensor's error relative to its size (an element near zero has no relative
    error worth the name)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def compare(name: str, got: dict, want: dict) -> None:
    torch.testing.assert_close(got["losses"], want["losses"], rtol=RTOL, atol=0, msg=lambda m: f"{name}: losses {m}")
    assert got["params"].keys() == want["params"].keys(), name
    errors = {key: relative_error(got["params"][key], value) for key, value in want["params"].items()}
    if os.environ.get("MUON_PARITY_REPORT"):
        print(name, "worst", sorted(errors.items(), key=lambda kv: -kv[1])[:4], flush=True)
    for key, value in want["params"].items():
        assert not torch.equal(value, want["initial"][key]), f"{name}: {key} never moved"
    wrong = {key: error for key, error in errors.items() if error > RTOL}
    assert not wrong, f"{name}: parameters differ from one process by more than {RTOL:g} relative: {wrong}"
    for step, (mine, theirs) in enumerate(zip(got["maxima"], want["maxima"], strict=True)):
        for layer, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: max logits {step} {layer} {m}"
            )


def check_cases(rank: int, world_size: int, cases: list[dict]) -> None:
    """Every case against its one-process run (rank 0 runs that and compares)."""
    references = {}
    for case in cases:
        result = train_case(case, world_size)
        if rank == 0:
            reference = {k: case[k] for k in ("model", "qk_clip", "lr", "pump") if k in case}
            key = tuple(sorted(reference.items()))
            if key not in references:
                references[key] = train_case(reference, 1)
            compare(case["name"], result, references[key])
            if case.get("qk_clip"):  # the case must clip: some head's first-step maximum past tau
                assert max(m.max().item() for m in result["maxima"][0]) > case["qk_clip"], case["name"]
            expected = STEPS * matrices_per_step(case.get("model", "dense"))
            assert result["orthogonalized"] == expected, (
                f"{case['name']}: {result['orthogonalized']} matrices orthogonalized over the ranks, "
                f"{expected} = {STEPS} steps x each matrix once"
            )
            print("PASSED", case["name"], flush=True)
        dist.barrier()
