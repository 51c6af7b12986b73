"""Expert-parallel parity harness: a tiny MoE model (grouped-query attention, or with `"model": "mla"` DeepSeek's
latent attention, group-limited routing and YaRN) trained a few steps under a layout (ep with FSDP,
HSDP, TP, CP, PP, activation checkpointing, compile) against one process, same seed, fp32, gloo.

Compared with the one-process run (rank 0): losses, gradient norms, every gradient (full_tensor,
gathered by name across pipeline stages), the initial weights, each step's expert loads summed over
ranks (the router's choices in aggregate, exactly), the router's chosen experts for every token of a
fixed batch after training (layouts whose forward takes whole sequences: not cp, not pp), and each
MoE layer's balancing bias, which must also be bit-equal on every rank.
"""

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from tests.helpers.parity import GLOBAL_BATCH, MICRO_BATCH, SEED, SEQ_LEN, RandomWindows, _compare, _full, case_layout
from trillion.models import PRESETS, Transformer
from trillion.models.args import MLAArgs, YaRNArgs
from trillion.models.moe import AUX_TIMES_TOKENS, DROPPED, SEQ_AUX_TIMES_TOKENS, moe_layers
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.ep_exchange import Traffic
from trillion.parallel.expert_parallel import ExpertDispatch, expert_dispatches
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.data.loader import DataLoader
from trillion.trainer.step import train_step

BASE = dataclasses.replace(
    PRESETS["debug-moe"], n_layers=3, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=32
)
BASE = dataclasses.replace(
    BASE,
    moe=dataclasses.replace(
        BASE.moe, n_experts=8, top_k=2, expert_ffn_dim=32, n_shared_experts=1, n_dense_layers=1, bias_update_rate=0.0
    ),
)
# debug-deepseek's kind at this size: low-rank queries, query/key heads (12) wider than value heads (8)
MLA = dataclasses.replace(
    BASE,
    n_kv_heads=None,
    mla=MLAArgs(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=24),
    yarn=YaRNArgs(factor=4, original_max_seq_len=8, mscale_all_dim=1.0),
    moe=dataclasses.replace(BASE.moe, n_groups=4, topk_groups=2, route_scale=2.5),
)
MODELS = {
    "gqa": BASE,
    "gqa-kv4": dataclasses.replace(BASE, n_kv_heads=4),  # 4 key/value heads: tp 4 splits them
    "mla": MLA,
    "mla-full-q": dataclasses.replace(MLA, mla=dataclasses.replace(MLA.mla, q_lora_rank=0)),
}
VARIANTS = {  # MoE settings on top of BASE.moe
    "plain": {},
    "aux": {"aux_loss_coef": 0.01},
    "seq-aux": {"seq_aux_loss_coef": 0.01},  # DeepSeek-V3's alpha is 1e-4; larger here so the gradient shows
    "bias": {"bias_update_rate": 1e-3},
    "mtp": {},
    # a per-rank capacity of one even share: ep 2 drops some tokens, one process (told of the 2 ranks) the same
    "capacity": {"rank_capacity_factor": 1.0, "capacity_ranks": 2},
    # folded over tp 2: each tp rank routes half of every sequence, its own capacity (one process told so: 2 shards)
    "capacity-folded": {"rank_capacity_factor": 1.0, "capacity_ranks": 2, "capacity_shards": 2},
}
# Layout's; the capacity is the model's (variant)
LAYOUT_KEYS = ("ep_dispatch", "ranks_per_node", "ep_overlap", "ep_pairing_phase", "defer_weight_grads")


MTP = {"mtp_modules": 1, "mtp_loss_weight": 0.3}  # the "mtp" variant's model settings: an MoE block predicting ahead


def model_args(variant: str, model: str = "gqa"):
    base = dataclasses.replace(MODELS[model], **MTP) if variant == "mtp" else MODELS[model]
    return dataclasses.replace(base, moe=dataclasses.replace(base.moe, **VARIANTS[variant]))


def _dims(case: dict, world_size: int, args) -> ParallelDims:
    layout = case_layout(
        case,
        world_size,
        **{k: case[k] for k in LAYOUT_KEYS if k in case},
        ep_capacity=args.moe.rank_capacity_factor,
        float8=case.get("float8"),  # a Float8Training (tests/float8/test_experts_parity.py)
    )
    check_layout(layout, args, SEQ_LEN)
    dims = ParallelDims(layout, world_size)
    dims.build_mesh("cpu")
    return dims


def _build(case: dict, dims: ParallelDims, args):
    """(runner, the model parts on this rank)."""
    backend = case.get("compile") or "inductor"

    def layout(part):
        return parallelize(part, dims, compile_backend=backend)

    with torch.device("meta"):
        model = Transformer(args)
    if dims.pp == 1:
        layout(model)
        model.to_empty(device="cpu")
        model.init_weights(SEED)
        return MicroBatchLoop(model, dims.layout, args.mtp_loss_weight, args.mtp_modules), [model]
    pipeline = Pipeline(model, dims, torch.device("cpu"), parallelize_fn=layout)
    for part in pipeline.parts:
        part.to_empty(device="cpu")
        part.init_weights(SEED)
    pipeline.build()
    return pipeline, pipeline.parts


def train_case(case: dict, world_size: int) -> dict:
    args = model_args(case.get("variant", "plain"), case.get("model", "gqa"))
    dims = _dims(case, world_size, args)
    runner, parts = _build(case, dims, args)
    named = list(runner.model.named_parameters())  # what the trainer's optimizer steps (a V's stages: one embedding)
    initial = {n: _full(p) for n, p in named}
    optimizer = torch.optim.AdamW([p for _, p in named], lr=3e-3, weight_decay=0.1, foreach=True)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append({n: _full(p.grad) for n, p in named}))
    loader = DataLoader(
        RandomWindows(args.vocab_size, SEQ_LEN + 1),
        GLOBAL_BATCH,
        case.get("micro", MICRO_BATCH),
        dims.dp_rank,
        dims.dp_size,
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    traffic = _count_rows(parts) if case.get("count_rows") else None
    losses, norms, loads, ahead = [], [], [], []
    layers = {i: layer for part in parts for i, layer in moe_layers(part).items()}
    for _ in range(case.get("steps", 3)):
        loss, norm = train_step(
            runner, loader.next_batch(), optimizer, scaler, contextlib.nullcontext(), 0.5, dims=dims
        )
        losses.append(loss.item())
        norms.append(norm.item())
        if runner.ahead_loss is not None:  # multi-token prediction's, summed over the ranks by train_step
            ahead.append(runner.ahead_loss.item())
        loads.append({i: layer.last_step_tally.clone() for i, layer in layers.items()})
    if case.get("defer_weight_grads"):  # some rank's input passes queued weight gradients a later W computed
        computed = torch.tensor(float(sum(part.weight_grad_queue.computed for part in parts)))
        dist.all_reduce(computed)  # a rank whose backwards all run full (paired, or the V's turn) queues none
        assert computed > 0, case["name"]
    if case.get("paired") and all(moe_layers(part) for part in parts):
        # DualPipeV's OVERLAP_F_B ran paired, its two stages' sides taking turns at the all-to-alls
        assert runner.handovers and min(runner.handovers) > 0, runner.handovers
    result = {
        "losses": losses,
        "norms": norms,
        "ahead": ahead,
        "grads": grads,
        "initial": initial,
        "loads": loads,
        "bias": {i: _bias(layer) for i, layer in layers.items()},
        "host_reads": {i: _host_reads(layer) for i, layer in layers.items()},
    }
    if traffic is not None:  # every rank's (rows its dispatches posted, tokens they routed), in rank order
        result["rows"] = [None] * world_size
        dist.all_gather_object(result["rows"], (traffic.posted_rows.get("dispatch", 0), traffic.tokens))
        result["posted"] = dict(traffic.posted_rows)  # this rank's, by what each post carried
    if dims.pp == 1 and dims.cp == 1:
        result["choices"] = router_choices(parts[0], args, dims)
    if dims.pp > 1:
        result = _merge_stages(result, world_size)
    return result


def _count_rows(parts) -> Traffic:
    """One Traffic for every dispatch of this rank: the rows its all-to-alls are posted, counted where they are."""
    traffic = Traffic()
    for part in parts:
        for dispatch in expert_dispatches(part):
            for exchange in {dispatch.exchange, *dispatch.exchanges()}:
                exchange.traffic = traffic
    return traffic


def check_half_the_rows(name: str, folded: list, whole: list, tp: int) -> None:
    """Folded over tp, the tp ranks of a tp group route disjoint shares of its tokens, so together they post exactly
    the rows each of them posts with the experts tensor-parallel (every tp rank the whole group's tokens): each posts
    1/tp of them, on average over the group (counted rows: `folded`, `whole`, each rank's (rows, tokens))."""
    for group in range(len(folded) // tp):
        ranks = range(group * tp, (group + 1) * tp)
        assert all(folded[r][1] * tp == whole[r][1] for r in ranks), (name, folded, whole)
        assert sum(folded[r][0] for r in ranks) == whole[group * tp][0], (name, folded, whole)
        assert all(whole[r] == whole[group * tp] for r in ranks), (name, whole)  # the duplicated sends
    print(f"{name}: rows posted per rank {[r[0] for r in folded]} folded, {[r[0] for r in whole]} before", flush=True)


def _bias(layer) -> torch.Tensor | None:
    bias = layer.router.expert_bias
    return None if bias is None else bias.clone()


def _host_reads(layer) -> int:
    dispatch = getattr(layer.dispatch, "inner", layer.dispatch)  # inside the tp gradient sum (etp = tp)
    return dispatch.host_reads if isinstance(dispatch, ExpertDispatch) else 0


def router_choices(model, args, dims=None) -> dict:
    """Each MoE layer's chosen experts for every token of one fixed batch (the same on every rank; folded over tp,
    each tp rank's routed positions gathered)."""
    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(SEED + 1))
    chosen, hooks = {}, []
    for index, layer in moe_layers(model).items():
        hooks.append(
            layer.router.register_forward_hook(lambda _m, _i, out, index=index: chosen.update({index: out[1]}))
        )
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    if dims is not None and dims.layout.folded:
        chosen = {i: _gathered_positions(c, tokens.shape[0], dims.tp_mesh.get_group()) for i, c in chosen.items()}
    return {i: c.sort(dim=-1).values for i, c in chosen.items()}


def _gathered_positions(local: torch.Tensor, sequences: int, group) -> torch.Tensor:
    """(sequences x positions, k) from each rank's (sequences x its positions, k), the ranks' positions in order."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat([p.view(sequences, -1, local.shape[-1]) for p in pieces], dim=1).flatten(0, 1)


def _merge_stages(result: dict, world_size: int) -> dict:
    """Every stage's per-layer and per-name entries merged (the pipeline ranks hold different layers)."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {k: result[k] for k in ("initial", "grads", "loads", "bias", "host_reads")})
    merged = dict(result, initial={}, grads=[{} for _ in result["grads"]], loads=[{} for _ in result["loads"]])
    merged["bias"], merged["host_reads"] = {}, {}
    for other in gathered:
        merged["initial"].update(other["initial"])
        merged["bias"].update(other["bias"])
        merged["host_reads"].update(other["host_reads"])
        for mine, theirs in zip(merged["grads"], other["grads"]):
            mine.update(theirs)
        for mine, theirs in zip(merged["loads"], other["loads"]):
            mine.update(theirs)
    return merged


def _compare_routing(name: str, actual: dict, expected: dict) -> None:
    for step, (got, want) in enumerate(zip(actual["loads"], expected["loads"])):
        assert got.keys() == want.keys(), name
        for index in want:  # E loads, dropped slots, tokens exactly; the auxiliary losses x tokens (float sums)
            floats = [len(want[index]) + AUX_TIMES_TOKENS, len(want[index]) + SEQ_AUX_TIMES_TOKENS]
            counts = [i for i in range(len(want[index])) if i not in floats]
            assert torch.equal(got[index][counts], want[index][counts]), f"{name}: step {step} layer {index} loads"
            torch.testing.assert_close(got[index][floats], want[index][floats], rtol=1e-5, atol=1e-6)
    if "choices" in actual:
        for index, want in expected["choices"].items():
            assert torch.equal(actual["choices"][index], want), f"{name}: layer {index} router choices differ"
    for index, want in expected["bias"].items():
        if want is not None:
            torch.testing.assert_close(actual["bias"][index], want, rtol=0, atol=1e-7, msg=f"{name}: bias {index}")


def _check_bias_same_on_every_rank(name: str, result: dict, world_size: int) -> None:
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result["bias"])
    for other in gathered:
        for index, bias in result["bias"].items():
            if bias is not None and index in other:
                assert torch.equal(other[index], bias), f"{name}: layer {index} bias differs across ranks"


def check_cases(rank: int, world_size: int, cases: list[dict]) -> None:
    """Entry point for run_ranks: every case against one process (rank 0 runs it and compares)."""
    references, results = {}, {}
    for case in cases:
        name = case["name"]
        result = results[name] = train_case(case, world_size)
        _check_bias_same_on_every_rank(name, result, world_size)
        if rank == 0:
            # the micro-batch size too: a per-rank capacity counts a micro-batch's tokens
            key = (case.get("variant", "plain"), case.get("steps", 3), case.get("model", "gqa"), case.get("micro"))
            if key not in references:
                reference = {"variant": key[0], "steps": key[1], "model": key[2], "micro": key[3] or MICRO_BATCH}
                references[key] = train_case(reference, world_size=1)
            tol = case.get("tol")  # {"rtol": ..., "atol": ...}: the elementwise tolerance, if not the default
            _compare(name, result, references[key], tol=tol, relative=case.get("relative", 0.0))
            torch.testing.assert_close(
                result["ahead"], references[key]["ahead"], **(tol or {"rtol": 2e-4, "atol": 2e-6})
            )
            _compare_routing(name, result, references[key])
            if "same_as" in case:
                _compare(f"{name} vs {case['same_as']}", result, results[case["same_as"]], exact=True)
            if case.get("drops"):  # the capacity dropped tokens (and one process the same: _compare_routing)
                assert any(load[DROPPED] > 0 for step in result["loads"] for load in step.values()), name
            if "half_the_rows_of" in case:
                check_half_the_rows(name, result["rows"], results[case["half_the_rows_of"]]["rows"], case["tp"])
            if "host_reads" in case:
                assert set(result["host_reads"].values()) == {case["host_reads"]}, (name, result["host_reads"])
            print("PASSED", name, flush=True)
        dist.barrier()
