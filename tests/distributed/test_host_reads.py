"""The steady-state step never waits for the device: between logging steps the host reads no tensor
value (on a GPU every such read drains the device queue), in one process and under FSDP, TP,
pipelining and context parallelism on gloo. Counted by trillion.trainer.metrics.profiling's
HostReadCounter (it wraps the Tensor methods that read values); a planted `.item()` must be seen."""

import json

from tests.helpers.flags import NO_CHECKPOINTS, SMALL_MODEL
from tests.helpers.spawn import as_launched, run_ranks
from trillion.trainer.config.schema import load_config
from trillion.trainer.metrics.profiling import HostReadCounter
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks, train

STEPS, LOG_FREQ = 7, 3
LOGGED = {1, 3, 6, STEPS}  # the first step, every log_freq-th and the last
STEADY = set(range(1, STEPS + 1)) - LOGGED
FLAGS = [
    *SMALL_MODEL,
    "--training.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    f"--training.steps={STEPS}",
    f"--metrics.log_freq={LOG_FREQ}",
    "--eval.interval=0",
    *NO_CHECKPOINTS,
    "--logging.progress_bar=lines",
]
LAYOUTS = {
    "dp_shard": ["--parallel.dp_shard=2"],
    "tp": ["--parallel.tp=2"],
    "pp": ["--parallel.pp=2", "--training.micro_batch_size=1"],
    "cp": ["--parallel.cp=2"],
}


def reads(out, *layout, hooks: RunHooks | None = None) -> dict[int, int]:
    counter = HostReadCounter()
    hooks = hooks or RunHooks()
    hooks.iteration = counter.iteration
    train(load_config(None, [*FLAGS, f"--job.output_dir={out}", *layout]), hooks=hooks)
    return counter.reads


def test_one_process_reads_nothing_between_logging_steps(tmp_path):
    counted = reads(tmp_path / "one")
    assert set(counted) == set(range(1, STEPS + 1))
    assert {step: counted[step] for step in STEADY} == dict.fromkeys(STEADY, 0), counted
    assert all(counted[step] > 0 for step in LOGGED)  # the logged steps read loss and norm: the counter sees


def test_a_mixture_of_experts_reads_nothing_between_logging_steps(tmp_path):
    """Routing, the grouped GEMM, the load tally and the balancing bias's step all stay on the device
    (expert parallelism reads its all-to-all split sizes on the host: that is not this layout)."""
    counted = reads(tmp_path / "moe", "--model.name=debug-moe", "--kernels.grouped_gemm=torch")
    assert {step: counted[step] for step in STEADY} == dict.fromkeys(STEADY, 0), counted


def test_a_planted_item_in_the_step_is_counted(tmp_path):
    def step_with_a_read(*args, **kwargs):
        loss, grad_norm = train_step(*args, **kwargs)
        loss.item()  # the kind of line this test exists to catch
        return loss, grad_norm

    counted = reads(tmp_path / "planted", hooks=RunHooks(step=step_with_a_read))
    assert all(counted[step] >= 1 for step in STEADY), counted


def _layouts(rank, world_size, root):
    as_launched(rank, world_size)
    found = {name: reads(root / name, *layout) for name, layout in LAYOUTS.items()}
    (root / f"reads-{rank}.json").write_text(json.dumps(found))


def test_fsdp_tp_pp_and_cp_read_nothing_between_logging_steps(tmp_path):
    run_ranks(_layouts, 2, tmp_path)
    for rank in range(2):
        found = json.loads((tmp_path / f"reads-{rank}.json").read_text())
        for name, counted in found.items():
            steady = {step: counted[str(step)] for step in STEADY}
            assert steady == dict.fromkeys(STEADY, 0), (name, rank, counted)


EXPERT_PARALLEL = ["--model.name=debug-moe", "--parallel.dp_shard=2", "--parallel.ep=2"]  # 1 MoE layer of the 2


def _expert_parallel(rank, world_size, root):
    as_launched(rank, world_size)
    found = {
        # dropless: the split sizes read once per MoE layer forward, none in the recomputes of full AC
        "dropless": reads(root / "dropless", *EXPERT_PARALLEL, "--parallel.activation_checkpoint=full"),
        "capacity": reads(root / "capacity", *EXPERT_PARALLEL, "--moe.rank_capacity_factor=1.5"),
    }
    (root / f"reads-{rank}.json").write_text(json.dumps(found))


def test_expert_parallel_reads_once_per_moe_forward_dropless_and_never_with_a_capacity(tmp_path):
    run_ranks(_expert_parallel, 2, tmp_path)
    forwards = 8 // (2 * 2)  # micro-batches per step per rank, each one MoE layer forward
    for rank in range(2):
        found = json.loads((tmp_path / f"reads-{rank}.json").read_text())
        for name, per_forward in (("dropless", 1), ("capacity", 0)):
            steady = {step: found[name][str(step)] for step in STEADY}
            assert steady == dict.fromkeys(STEADY, forwards * per_forward), (name, rank, found[name])
