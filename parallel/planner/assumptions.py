"""What the planner assumes about a run beyond its layout (parallel/layout.py): figures no layout setting fixes,
which the planner costs (some the trainer reads too: the optimizer, its moments' dtype, the average's decay; others
are the run's facts: the load imbalance, the documents' lengths). `trillion plan` takes them as flags
(--moe-load-imbalance, --optimizer, --optimizer-state-dtype, --documents, --ema-decay), `trillion estimate` and the
memory pre-flight from the run's config (its optimizer, its moments' dtype and its average's decay), and the
planner's functions receive them beside the layout, explicitly (memory.layout_memory, cost.step_time)."""

from dataclasses import asdict, dataclass

from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """The defaults are the planner's: a measured load imbalance, AdamW, attention over whole sequences."""

    moe_load_imbalance: float = MOE_LOAD_IMBALANCE  # the busiest ep rank's routed tokens over the mean (moe.py)
    optimizer: str = "adamw"  # adamw | muon: the optimizer's state and step work (optimizer.py)
    optimizer_state_dtype: str = "float32"  # optimizer.state_dtype: AdamW's moments' (optimizer.py)
    attention_share: float = 1.0  # document masking: the attention work left (models/flops.py)
    ema_decay: float = 0.0  # optimizer.ema_decay (0: none): the parameters' average, in host memory (optimizer.py)

    def as_dict(self) -> dict:
        return asdict(self)


ASSUMED = Assumptions()
