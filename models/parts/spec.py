"""The vocabulary of a part's declaration: plain frozen data, no torch.

A part (an attention, an MLP, a mixture of experts, a multi-token prediction module, the embeddings and
the head) declares once what the other packages need to know about it without building it: its linears
(their module names inside the block, their features, how tensor parallelism splits them), its norms, its
expert stacks, its attention shape, the activation elements it keeps for backward and the element-wise
work it does per token, the sizes a parallel degree must divide and the layouts it cannot train under.
models/flops.py counts parameters from it, parallel/tensor_parallel.py turns its splits into placements,
and the planner (parallel/planner/) costs memory and time from it. Megatron-Core's ModuleSpec and
torchtitan's per-model sharding plans play the same role there.
"""

from dataclasses import dataclass

# How tensor parallelism splits a linear: by output features (each rank a slice of the heads or of the
# hidden width), by input features (the partial results reduce-scattered), or not at all.
COLUMN, ROW, REPLICATED = "column", "row", "replicated"

# How a part runs under tensor parallelism (parallel/tensor_parallel.py):
#   HEADS          input all-gathered from the sequence-parallel stream, column linears' outputs local tensors,
#                  the row linear reduce-scattered back; float8 styles where its linears are float8
#   DTENSOR_HEADS  the same, but its tensors stay DTensors (the rotary table passed in replicated) until
#                  `attend`, which gets this rank's heads as plain tensors: a head shared by all ranks' heads
#                  (latent attention's rotary key) gets its gradient summed over them; plain styles
#   ROUTED         a router and expert stacks (the mixture of experts), laid out by parallel.etp: the experts split
#                  like an MLP over all-gathered tokens, or ep folded over the tp ranks, each routing its own tokens
#                  (parallel/expert_tensor_parallel.py)
HEADS, DTENSOR_HEADS, ROUTED = "heads", "dtensor_heads", "routed"


@dataclass(frozen=True)
class Linear:
    name: str  # module path inside the block ("attention.wq"), or inside the model for the root's
    in_features: int
    out_features: int
    split: str = COLUMN
    bias: bool = False

    @property
    def tp_dim(self) -> int | None:
        """The weight's (out, in) dimension tensor parallelism splits; None: replicated."""
        return {COLUMN: 0, ROW: 1, REPLICATED: None}[self.split]

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class Norm:
    name: str
    features: int
    bias: bool = False  # a LayerNorm with a bias; every norm is replicated over tp

    @property
    def numel(self) -> int:
        return self.features * (2 if self.bias else 1)


@dataclass(frozen=True)
class Table:
    """An embedding table (rows x dim); tensor parallelism splits its rows (vocabulary-parallel)."""

    name: str
    rows: int
    dim: int


@dataclass(frozen=True)
class ExpertStack:
    """E experts' weights of one projection stacked as (E, in, out), split over ep; expert tensor parallelism splits
    each expert like a linear of that split (parallel.etp = tp), or keeps it whole (etp = 1)."""

    name: str
    n_experts: int
    in_features: int
    out_features: int
    split: str = COLUMN

    @property
    def tp_dim(self) -> int:
        """The (E, in, out) dimension expert tensor parallelism splits: out for a column stack, in for a row one."""
        return {COLUMN: 2, ROW: 1}[self.split]

    @property
    def numel(self) -> int:
        return self.n_experts * self.in_features * self.out_features


@dataclass(frozen=True)
class Heads:
    """The attention's shape for FLOPs and context parallelism: query heads, the heads whose keys and values it
    reads (grouped-query: the kv heads; latent attention expands every head's), query/key and value head widths."""

    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int

    @property
    def kv_width(self) -> int:
        """Elements per token of the keys and values attention reads (what context parallelism gathers)."""
        return self.kv_heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class HeadRows:
    """Rows of a linear's weight (and bias) that make one attention head's part of its queries or keys: block h
    of `linear` is rows [h * stride + offset, h * stride + offset + width)."""

    linear: str
    stride: int
    offset: int
    width: int


@dataclass(frozen=True)
class LogitTerm:
    """One term of each head's pre-softmax logit, (query rows) . (key rows): head h's `query` block times the key
    block h // (heads / key blocks) of `key` (grouped-query attention shares one key block among a group), or a key
    every head shares (`key` None: latent attention's rotary key, which QK-clip leaves as it is). A head's logit is
    the sum of its terms; the QK-clip (parallel/muon/qk_clip.py) scales each term's rows to scale the logit."""

    query: HeadRows
    key: HeadRows | None


@dataclass(frozen=True)
class PerToken:
    """Elements per token: `split` divided over the tp ranks, `whole` on every one of them."""

    split: float = 0.0
    whole: float = 0.0

    def __add__(self, other: "PerToken") -> "PerToken":
        return PerToken(self.split + other.split, self.whole + other.whole)

    def on_rank(self, tp: int) -> float:
        return self.split / tp + self.whole


@dataclass(frozen=True)
class Divides:
    """A size a parallel degree must divide: the setting that sets it, its value, what it is."""

    setting: str
    value: int
    what: str


@dataclass(frozen=True)
class Refusal:
    """A setting of the part that cannot train under some parallel axes: `setting` as the user gave it
    ("model.mtp_modules=1"), each refused axis with why, and the fix; one message for the trainer's check and
    the planner's search (parts.layout_refusal)."""

    setting: str
    axes: tuple[tuple[str, str], ...]  # (axis, why it cannot) for each axis of size > 1 it refuses
    fix: str


@dataclass(frozen=True)
class Routing:
    """A router's choice of experts: its gate (replicated over tp, computed on local tensors), E and top_k, the
    elements per token its scores and choice read and write besides the gate, its extra kernel launches, and its
    groups (DeepSeek-V3's group-limited routing; expert parallelism lines them up with nodes)."""

    gate: Linear
    n_experts: int
    top_k: int
    elements: int
    kernels: int
    groups: int = 1  # group-limited routing: the experts in `groups` equal groups, a token's choices in
    groups_chosen: int = 1  # this many of them (1 group: unlimited)


@dataclass(frozen=True)
class Part:
    """One part's declaration (the module docstring). `module`: the block attribute it fills ("attention",
    "feed_forward"), or "" for a part outside the blocks. `saved`: activation elements per token kept for
    backward beyond the block's norm inputs and outputs; `eager` / `compiled`: element-wise elements read and
    written per token by its forward, each split over tp or whole; `eager_kernels`: its element-wise launches."""

    module: str
    linears: tuple[Linear, ...] = ()
    norms: tuple[Norm, ...] = ()
    experts: tuple[ExpertStack, ...] = ()
    heads: Heads | None = None
    routing: Routing | None = None
    saved: PerToken = PerToken()
    eager: PerToken = PerToken()
    compiled: PerToken = PerToken()
    eager_kernels: int = 0
    tp_style: str = HEADS
    tp_divides: tuple[Divides, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    logit_terms: tuple[LogitTerm, ...] = ()  # an attention's: what makes each head's logit (QK-clip scales them)
    logit_terms_absent: str = ""  # an attention without them: why its logits cannot be clipped by its weights
    # linears whose outputs DeepSeek's recompute mode recomputes in backward instead of keeping: latent attention's
    # up-projections (parallel/activation_checkpoint.py); `recomputed` the saved elements per token that spares
    up_projections: tuple[str, ...] = ()
    recomputed: PerToken = PerToken()

    @property
    def numel(self) -> int:
        gate = self.routing.gate.numel if self.routing else 0
        return sum(x.numel for x in (*self.linears, *self.norms, *self.experts)) + gate
