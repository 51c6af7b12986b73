"""Expert parallelism reproduces one process (tests/moe/harness.py): losses, gradient norms, every
gradient, the initial weights, the router's choices and per-step loads, the balancing bias (equal on
every rank), fp32 on gloo. Cases share a process group to amortize start-up. Every dispatch mode
(parallel/expert_parallel.py): per rank (the default), per expert, per node (4 ranks as 2 nodes of 2),
and the per-rank capacity (the same tokens dropped as one process told of the 2 ranks)."""

import pytest

from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases

# one split-size read per layer per forward: 2 micro-batches per rank x 3 steps
READS = 2 * 3
OVERLAP = {"dp_shard": 2, "ep": 2, "ep_overlap": True}
# the first two steps at 1e-6 relative (after them AdamW's normalisation magnifies float rounding: 2e-4)
TIGHT = {"rtol": 1e-6, "atol": 1e-8}
DEEPSEEK_RECOMPUTE = {"model": "mla", "ac": "deepseek"}  # recomputes latent attention's up-projections


def test_two_ranks_ep2_checkpointing_aux_loss_and_cp():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "ep2", "dp_shard": 2, "ep": 2, "host_reads": READS},
            {"name": "ep2-per-expert", "dp_shard": 2, "ep": 2, "ep_dispatch": "expert", "steps": 8},
            # fixed-size buffers: no split size read on the host, and tokens dropped as in one process
            {"name": "ep2-capacity", "dp_shard": 2, "ep": 2, "variant": "capacity", "host_reads": 0, "drops": True},
            # the recompute routes as the first forward did, from its cached route: no second exchange
            {"name": "ep2-ac-full", "dp_shard": 2, "ep": 2, "ac": "full", "same_as": "ep2", "host_reads": READS},
            {"name": "ep2-ac-op", "dp_shard": 2, "ep": 2, "ac": "selective:op", "host_reads": READS},
            # DeepSeek's recompute: no block replayed, so one split-size read per layer and forward, as without AC
            {
                "name": "ep2-deepseek-recompute",
                "dp_shard": 2,
                "ep": 2,
                "model": "mla",
                "ac": "deepseek",
                "host_reads": READS,
            },
            # the all-to-alls beside the shared experts and the other chunk's experts (zero3), recomputed under AC
            {"name": "ep2-overlap-ac-full", **OVERLAP, "ac": "full", "host_reads": READS},
            # zero2 keeps the blocks gathered: a step's two micro-batches in flight together (expert_overlap.py)
            {"name": "ep2-paired-ac-op", **OVERLAP, "mode": "zero2", "ac": "selective:op", "host_reads": READS},
            {"name": "ep2-aux-loss-zero2", "dp_shard": 2, "ep": 2, "variant": "aux", "mode": "zero2"},
            # DeepSeek-V3's sequence-wise balance loss: per-sequence statistics, which ep must leave alone
            {"name": "ep2-seq-aux-loss", "dp_shard": 2, "ep": 2, "variant": "seq-aux"},
            # multi-token prediction, its block an MoE block whose experts ep spreads like the trunk's
            {"name": "ep2-mtp", "dp_shard": 2, "ep": 2, "variant": "mtp"},
            {"name": "ep2-zero1", "dp_shard": 2, "ep": 2, "mode": "zero1"},
            {"name": "ep2xcp2", "dp_shard": 1, "cp": 2, "ep": 2},
            # its per-sequence statistics summed over the cp ranks before the product: cp 2 = cp 1
            {"name": "cp2-seq-aux-loss", "dp_shard": 1, "cp": 2, "variant": "seq-aux"},
            {"name": "tp2-ep1", "dp_shard": 1, "tp": 2},  # an MoE model under TP alone
            # the balancing bias after 10 steps: equal on both ranks and to one process's
            {"name": "ep2-bias", "dp_shard": 2, "ep": 2, "variant": "bias", "steps": 10},
        ],
    )


TWO_NODES = {"dp_shard": 4, "ep": 4, "ranks_per_node": 2, "steps": 8}  # ep 4 over 2 "nodes" of 2 ranks


def test_four_ranks_ep2_x_tp2_and_ep4_as_two_nodes_of_two():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "ep2xtp2", "dp_shard": 2, "tp": 2, "ep": 2},
            {"name": "ep4-per-rank", **TWO_NODES, "ep_dispatch": "rank"},
            {"name": "ep4-per-node", **TWO_NODES, "ep_dispatch": "node", "host_reads": 8},
            # debug-deepseek's kind (4 routing groups, 2 chosen: each node holds 2), recomputed under full AC; with
            # the overlap (nothing pairs under zero3) in two chunks of tokens, which the recompute replays
            {
                "name": "ep4-per-node-mla-ac-chunks",
                **TWO_NODES,
                "ep_dispatch": "node",
                "model": "mla",
                "ac": "full",
                "ep_overlap": True,
            },
        ],
    )


@pytest.mark.slow  # about two minutes on two cores
def test_four_ranks_fsdp_hsdp_pp_with_ep2():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "fsdp4-ep2", "dp_shard": 4, "ep": 2},  # the experts FSDP-sharded over the other 2
            {"name": "hsdp2x2-ep2", "dp_replicate": 2, "dp_shard": 2, "ep": 2, "mode": "zero1"},
            {"name": "ep2xpp2", "pp": 2, "dp_shard": 2, "ep": 2},
            {"name": "ep2xpp2-ac-full", "pp": 2, "dp_shard": 2, "ep": 2, "ac": "full", "same_as": "ep2xpp2"},
            # a zero-bubble schedule (split backward); with activation checkpointing it is refused (test_ep_config)
            {"name": "ep2xpp2-zbv", "pp": 2, "dp_shard": 2, "ep": 2, "schedule": "ZBVZeroBubble"},
        ],
    )


@pytest.mark.slow  # compile on two cores
def test_ep2_compiled_per_block():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "ep2-compile", "dp_shard": 2, "ep": 2, "compile": "aot_eager"},
            {"name": "ep2-per-expert-compile", "dp_shard": 2, "ep": 2, "ep_dispatch": "expert", "compile": "aot_eager"},
            {"name": "ep2-capacity-compile", "dp_shard": 2, "ep": 2, "variant": "capacity", "compile": "aot_eager"},
            {"name": "ep2-overlap-compile", "dp_shard": 2, "ep": 2, "ep_overlap": True, "compile": "aot_eager"},
        ],
    )


@pytest.mark.slow  # about a minute on two cores
def test_two_ranks_overlap_breadth():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "ep2-overlap", "dp_shard": 2, "ep": 2, "ep_overlap": True, "steps": 8},
            {"name": "ep2-overlap-selective", "dp_shard": 2, "ep": 2, "ep_overlap": True, "ac": "selective"},
            {"name": "ep2-overlap-capacity", "dp_shard": 2, "ep": 2, "ep_overlap": True, "variant": "capacity"},
            {"name": "ep2-overlap-per-expert", "dp_shard": 2, "ep": 2, "ep_overlap": True, "ep_dispatch": "expert"},
            {"name": "ep2-overlap-zero3-mla", "dp_shard": 2, "ep": 2, "ep_overlap": True, "model": "mla"},
            {"name": "ep2-paired-zero1-ac-full", **OVERLAP, "mode": "zero1", "ac": "full", "steps": 8},
            {"name": "ep2-paired-mla-mtp", **OVERLAP, "mode": "zero2", "model": "mla", "variant": "mtp"},
            {"name": "ep2-paired-selective", **OVERLAP, "mode": "zero2", "ac": "selective"},
            {
                "name": "ep2-paired-deepseek-mtp",
                **OVERLAP,
                "mode": "zero2",
                "model": "mla",
                "ac": "deepseek",
                "variant": "mtp",
            },
            # the first two steps at 1e-6 relative (after them AdamW's normalisation magnifies float rounding)
            {"name": "ep2-tight", "dp_shard": 2, "ep": 2, "steps": 2, "tol": TIGHT},
        ],
    )


@pytest.mark.slow  # about two minutes on two cores
def test_four_ranks_two_nodes_breadth():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "ep4-per-expert", **TWO_NODES, "ep_dispatch": "expert"},
            {"name": "ep4-per-node-overlap", **TWO_NODES, "ep_dispatch": "node", "ep_overlap": True},
            {"name": "ep4-per-node-ac-op", **TWO_NODES, "ep_dispatch": "node", "ac": "selective:op"},
            {
                "name": "ep4-per-node-mla-seq-aux",
                **TWO_NODES,
                "ep_dispatch": "node",
                "model": "mla",
                "variant": "seq-aux",
            },
            {
                "name": "ep4-per-node-tight",
                **TWO_NODES,
                "ep_dispatch": "node",
                "steps": 2,
                "tol": {"rtol": 1e-6, "atol": 1e-8},
            },
            {"name": "ep2xpp2-overlap", "pp": 2, "dp_shard": 2, "ep": 2, "ep_overlap": True},
        ],
    )
