"""Bytes of the expert dispatch per MoE layer and token, by stage (inter-node, intra-node), for each dispatch mode,
counted where the trainer's own dispatch (parallel/expert_parallel.py) posts its all-to-alls: DeepSeek-V3's
routing shape (256 experts, top-8, 8 groups of which 4 are allowed, ep 64 over 8 nodes of 8, hidden 7168 in bf16)
with balanced random routing and with routing recorded from a trained debug-deepseek reshaped to that routing; and
the per-node dispatch with DeepSeek's float8 wire (float8.dispatch: the rows in float8 with their scales).

The ranks are simulated in one process, one thread each, with the real ExpertDispatch: only the all-to-all itself
is replaced (ThreadExchange moves the rows between the threads; the count is Exchange's, as on a cluster), and the
experts by a pass-through (the bytes do not depend on their math). Each result is checked: every token gets back
the weighted sum of its rows.

    python experiments/bench/ep_dispatch.py [--tokens 64] [--steps 60] [--out DIR]
    python experiments/bench/ep_dispatch.py --smoke     # a small shape, seconds (tested)
"""

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trillion.models.args import MoEArgs  # noqa: E402
from trillion.models.moe import Router  # noqa: E402
from trillion.parallel.ep_exchange import STAGES, Exchange, Traffic  # noqa: E402
from trillion.parallel.ep_routing import Payload  # noqa: E402
from trillion.parallel.expert_overlap import in_threads  # noqa: E402
from trillion.parallel.expert_parallel import ExpertDispatch  # noqa: E402
from trillion.parallel.float8_dispatch import Float8Wire  # noqa: E402

MODES = ("expert", "rank", "node")
# (label, mode, payload): each mode in bf16, and the per-node dispatch with DeepSeek-V3's float8 wire (blockwise 1 x 128
# scales, emulated: the bytes are the wire's on any device)
RUNS = [(mode, mode, Payload()) for mode in MODES] + [
    ("node, float8 dispatch", "node", Payload(wire=Float8Wire("blockwise", emulate=True)))
]
DEEPSEEK_V3 = MoEArgs(n_experts=256, top_k=8, expert_ffn_dim=32, score_func="sigmoid", n_groups=8, topk_groups=4)


class _Board:
    """Where one group's members leave their rows for each other."""

    def __init__(self, size: int):
        self.barrier, self.posted = threading.Barrier(size), [None] * size


class _Done:
    def wait(self) -> None:
        pass


class ThreadExchange(Exchange):
    """Exchange among threads of one process: each member posts its split rows, all meet, each takes its own."""

    def __init__(self, board: _Board, me: int, ranks: list[int], ranks_per_node: int):
        self.board = board
        self.place(me, ranks, ranks_per_node)

    def _all_to_all(self, out, x, recv, send):
        board = self.board
        board.posted[self.me] = list(x.split(send))
        board.barrier.wait()
        out.copy_(torch.cat([board.posted[source][self.me] for source in range(self.size)]))
        board.barrier.wait()
        return _Done()


class _PassThrough(nn.Module):
    """Identity experts that apply the routing weights, as the experts do before their down projection."""

    permute_impl = "torch"  # the hops' combine (kernels.permutation) as on this CPU

    def forward(self, x, counts, weights):
        return x * weights.unsqueeze(-1).to(x.dtype)


def _dispatches(moe: MoEArgs, ep: int, ranks_per_node: int, mode: str, payload: Payload) -> list[ExpertDispatch]:
    """One ExpertDispatch per simulated rank, on thread exchanges laid out as the trainer's meshes (ranks 0.. of the
    ep group consecutive, ranks_per_node to a node), its rows travelling as `payload` has them."""
    layer = SimpleNamespace(experts=_PassThrough(), moe=moe)
    whole = _Board(ep)
    members, nodes = min(ranks_per_node, ep), max(1, ep // ranks_per_node)
    inter = [_Board(nodes) for _ in range(members)]
    intra = [_Board(members) for _ in range(nodes)]
    out = []
    for rank in range(ep):
        node, local = divmod(rank, members)
        exchanges = [ThreadExchange(whole, rank, list(range(ep)), ranks_per_node)]
        if mode == "node":
            exchanges.append(ThreadExchange(inter[local], node, list(range(local, ep, members)), ranks_per_node))
            exchanges.append(
                ThreadExchange(intra[node], local, list(range(node * members, (node + 1) * members)), ranks_per_node)
            )
        out.append(ExpertDispatch(layer, mode, *exchanges, payload=payload))
    return out


def simulate(
    routing: list[tuple], moe: MoEArgs, ep: int, ranks_per_node: int, dim: int, mode: str, payload=Payload()
) -> Traffic:
    """Every rank's dispatch of its tokens (routing: per rank (chosen experts, weights)), in threads, the rows as
    `payload` carries them (a float8 wire: parallel/float8_dispatch.py); the traffic summed over the ranks. Raises
    if a token does not get back the weighted sum of its rows (as the wire delivers them)."""
    dispatches, total = _dispatches(moe, ep, ranks_per_node, mode, payload), Traffic()
    for dispatch in dispatches:
        for exchange in dispatch.exchanges():
            exchange.traffic = total
        dispatch.exchange.traffic = total

    def run(rank: int) -> None:
        try:
            ids, weights = routing[rank]
            x = torch.randn(ids.shape[0], dim, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
            with torch.no_grad():
                out, _ = dispatches[rank](x, ids, weights)
                sent = x if payload.wire is None else payload.wire.decode(payload.wire.encode(x), dim, x.dtype)
            expected = sent.float() * weights.sum(dim=1, keepdim=True)
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
        except BaseException:
            for board in {e.board for d in dispatches for e in d.exchanges()}:
                board.barrier.abort()  # the other threads stop waiting for this one
            raise

    in_threads([lambda rank=rank: run(rank) for rank in range(ep)])
    return total


def random_routing(moe: MoEArgs, ep: int, tokens: int, seed: int = 0) -> list[tuple]:
    """Balanced random routing: the model's own Router (group-limited) on random inputs and gate."""
    torch.manual_seed(seed)
    router = Router(64, moe)
    with torch.no_grad():
        _, chosen, weights = router(torch.randn(ep * tokens, 64))
    return list(zip(chosen.split(tokens), weights.split(tokens)))


def recorded_routing(moe: MoEArgs, ep: int, tokens: int, steps: int, out: Path) -> list[tuple]:
    """Routing recorded from debug-deepseek with `moe`'s routing, trained `steps` steps on the default corpus (the
    loss-free bias balancing it): the first MoE layer's choices for a batch of ep x tokens held-out tokens."""
    from trillion.models.presets import PRESETS
    from trillion.trainer.config.schema import load_config
    from trillion.trainer.data import build_tokenizer
    from trillion.trainer.step import train_step
    from trillion.trainer.train import RunHooks, train

    base = PRESETS["debug-deepseek"]
    shape = {name: getattr(moe, name) for name in ("n_experts", "top_k", "n_groups", "topk_groups", "expert_ffn_dim")}
    PRESETS["bench-deepseek-v3-routing"] = dataclasses.replace(
        base, mtp_modules=0, moe=dataclasses.replace(base.moe, **shape)
    )
    runners = []

    def keep(runner, *args, **kwargs):
        runners.append(runner)
        return train_step(runner, *args, **kwargs)

    flags = ["--model.name=bench-deepseek-v3-routing", f"--training.steps={steps}", "--training.seq_len=128"]
    flags += ["--training.global_batch_size=8", "--eval.interval=0", "--checkpoint.save_final=false"]
    flags += [f"--job.output_dir={out}", "--logging.progress_bar=lines", "--job.device=cpu", "--job.overwrite=true"]
    config = load_config(None, flags)
    train(config, hooks=RunHooks(step=keep))
    model = runners[-1].model
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = torch.tensor(build_tokenizer(config.tokenizer).encode(text)[: ep * tokens]).view(-1, 128)
    chosen = {}
    layer = next(m for m in model.modules() if isinstance(m, Router))
    hook = layer.register_forward_hook(lambda _m, _i, output: chosen.update(ids=output[1], weights=output[2]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return list(zip(chosen["ids"].split(tokens), chosen["weights"].split(tokens)))


def table(rows: list[dict]) -> str:
    lines = [
        "| routing | dispatch | network rows/token | network KB/token | intra-node KB/token | network vs expert |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['routing']} | {r['mode']} | {r['network_rows']:.2f} | {r['network_kb']:.1f} | {r['intra_kb']:.1f} "
            f"| {r['network_vs_expert']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens per simulated rank")
    p.add_argument("--steps", type=int, default=60, help="training steps before recording routing")
    p.add_argument("--out", default="experiments/bench/results")
    p.add_argument("--smoke", action="store_true")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    moe, ep, per_node, dim = DEEPSEEK_V3, 64, 8, 7168
    if ns.smoke:
        moe = MoEArgs(n_experts=16, top_k=4, expert_ffn_dim=8, score_func="sigmoid", n_groups=4, topk_groups=2)
        ep, per_node, dim, ns.tokens, ns.steps = 8, 2, 64, 16, 2
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    routings = {"balanced random": random_routing(moe, ep, ns.tokens)}
    routings["recorded (debug-deepseek)"] = recorded_routing(moe, ep, ns.tokens, ns.steps, out / "ep_dispatch_run")
    rows = []
    for name, routing in routings.items():
        expert_network = None
        for label, mode, payload in RUNS:
            start = time.perf_counter()
            traffic = simulate(routing, moe, ep, per_node, dim, mode, payload)
            network, intra = (
                sum(traffic.per_token(what, stage) for what in ("dispatch", "routing")) for stage in STAGES
            )
            expert_network = expert_network or network
            rows.append(
                {
                    "routing": name,
                    "mode": label,
                    "network_rows": traffic.per_token("dispatch", STAGES[0], rows=True),
                    "network_kb": network / 1e3,
                    "intra_kb": intra / 1e3,
                    "network_vs_expert": network / expert_network,
                    "seconds": time.perf_counter() - start,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    (out / "ep_dispatch.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
