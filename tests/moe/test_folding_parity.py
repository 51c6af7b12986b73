"""MoE parallel folding reproduces one process (tests/moe/harness.py; parallel/expert_tensor_parallel.py): with
parallel.etp=1 ep borrows the tp ranks, each tp rank routes and sends only its sequence-parallel tokens, and the
auxiliary losses' statistics and the step's tallies are summed over the ranks routing the other tokens; with
etp = tp the experts are tensor-parallel. The loss of every one of 8 steps, and the first step's gradient norm and
every gradient, within 1e-6 relative (later steps' gradients and norms elementwise within the harness's tolerance:
they start from weights the optimizer moved by rounding-sized amounts, which AdamW's normalization magnifies;
tests/helpers/parity.py _compare_relative), the router's choices and the per-step expert loads exactly, fp32 on
gloo. debug-moe's kind (grouped-query attention, shared experts) and debug-deepseek's (latent attention,
group-limited routing)."""

import pytest

from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases

STRICT = {"steps": 8, "relative": 1e-6}
FOLDED_4 = {"dp_shard": 2, "tp": 2, "ep": 4}  # ep 4 over tp 2 x dp_shard 2: consecutive ranks
# ... as 2 nodes of 2 ranks (tp inside the node): per rank the same run as on one node, per node two hops
TWO_NODES = {**FOLDED_4, "ranks_per_node": 2}


def test_two_ranks_ep_over_the_tp_ranks():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "tp2-ep2-folded", "dp_shard": 1, "tp": 2, "ep": 2, "host_reads": 4 * 8, **STRICT},
            {"name": "tp2-ep2-folded-mla-seq-aux", "dp_shard": 1, "tp": 2, "ep": 2, "model": "mla", **STRICT},
            # a per-rank capacity on each tp rank's own tokens: one process told of the 2 shards drops the same
            {"name": "tp2-ep2-folded-capacity", "dp_shard": 1, "tp": 2, "ep": 2, "variant": "capacity-folded"},
            # the auxiliary loss's statistics summed over the tp ranks before the product
            {"name": "tp2-ep2-folded-aux", "dp_shard": 1, "tp": 2, "ep": 2, "variant": "aux"},
        ],
    )


def test_four_ranks_folded_over_tp_dp_and_pp():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "tp2-dp2-ep4-per-rank-two-nodes", **TWO_NODES, "ep_dispatch": "rank", **STRICT},
            {
                "name": "tp2-dp2-ep4-per-node-two-nodes-mla",
                **TWO_NODES,
                "ep_dispatch": "node",
                "model": "mla",
                **STRICT,
            },
            {"name": "tp2-ep2-pp2", "pp": 2, "dp_shard": 1, "tp": 2, "ep": 2, **STRICT},
            # etp = tp: each expert split over tp on the (ep, etp) mesh, FSDP over the data-parallel ranks left
            {"name": "tp2-dp2-ep2-etp2", "dp_shard": 2, "tp": 2, "ep": 2, "etp": 2, "count_rows": True},
            # the same degrees folded: each tp rank posts its half of the rows both posted (the duplicated sends gone)
            {
                "name": "tp2-dp2-ep2-folded",
                **{"dp_shard": 2, "tp": 2, "ep": 2, "count_rows": True, "half_the_rows_of": "tp2-dp2-ep2-etp2"},
            },
        ],
    )


@pytest.mark.slow  # about two minutes on two cores
def test_folding_breadth():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "tp2-ep2-pp2-mla", "pp": 2, "dp_shard": 1, "tp": 2, "ep": 2, "model": "mla", **STRICT},
            {"name": "tp2-dp2-ep4-mla-per-rank", **FOLDED_4, "model": "mla", **STRICT},
            {"name": "cp2-tp2-ep4-seq-aux", "dp_shard": 1, "cp": 2, "tp": 2, "ep": 4, "variant": "seq-aux"},
            {"name": "cp2-tp2-ep4-aux", "dp_shard": 1, "cp": 2, "tp": 2, "ep": 4, "variant": "aux"},
            {"name": "tp2-dp2-ep4-bias", **FOLDED_4, "variant": "bias", "steps": 10},
            {"name": "tp2-dp2-ep4-overlap-ac", **FOLDED_4, "ep_overlap": True, "ac": "full"},
            {"name": "tp2-dp2-ep4-per-expert", **FOLDED_4, "ep_dispatch": "expert"},
            {"name": "tp2-dp2-ep4-mtp-ac-op", **FOLDED_4, "variant": "mtp", "ac": "selective:op"},
            {"name": "tp2-dp2-ep2-etp2-mla", "dp_shard": 2, "tp": 2, "ep": 2, "etp": 2, "model": "mla"},
            {"name": "hsdp-tp2-ep2", "dp_replicate": 2, "dp_shard": 1, "tp": 2, "ep": 2, "mode": "zero1"},
        ],
    )
