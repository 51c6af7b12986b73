"""The run's configuration: one small dataclass per component, loaded from TOML and overridden
from the command line (`--section.field=value`), checked before any work starts.

Every field carries its documentation, which `trillion train --help` prints, and its check
(trainer/config/checks.py: ranges, choices, paths), run by `validate_config` once the file and the
overrides are read; relations between a section's fields are its `check_relations` method.
Each component receives only its own section, never the whole Config.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from trillion.errors import ConfigError
from trillion.parallel.modes import (
    CHECKPOINT_MODES,
    DEFAULT_VIRTUAL_STAGES,
    FLOAT8_ALL_GATHER,
    FLOAT8_RECIPES,
    SCHEDULES,
    SELECTIVE_EVERY,
    ZERO_MODES,
    float8_recipe,
)
from trillion.trainer.config.checks import Check, CreatableDir, ExistingPath, Flag, OneOf, Range, Text


# Choices made in lower layers, imported when a value is checked: `trillion plan` reads configs without torch.
def preset_names() -> tuple:
    from trillion.models.presets import PRESETS

    return tuple(PRESETS)


def attention_impls() -> tuple:
    from trillion.kernels import ATTENTION_IMPLS

    return ATTENTION_IMPLS


def norm_impls() -> tuple:
    from trillion.kernels import NORM_IMPLS

    return NORM_IMPLS


def grouped_gemm_impls() -> tuple:
    from trillion.kernels import GROUPED_GEMM_IMPLS

    return GROUPED_GEMM_IMPLS


def doc(default, text: str, check: Check | None = None):
    """A dataclass field with a default, the help text `--help` shows and the check of its values
    (tests/test_config_validation.py fails for a field declared without one)."""
    return field(default=default, metadata={"doc": text, "check": check})


POSITIVE, NONNEGATIVE, KEEP = Range(1), Range(0), {0: "keep the preset's"}


@dataclass
class Job:
    output_dir: str = doc(
        "outputs/default", "Run directory: resolved config, metrics.jsonl, checkpoints/, wandb/.", CreatableDir()
    )
    seed: int = doc(
        0,
        "Seed of weight init and data order; the same seed gives the same run whatever the layout.",
        Range(0, 2**63 - 1),
    )
    device: str = doc(
        "auto",
        "auto (the GPU when there is one, else CPU) | cpu | cuda (NVIDIA and AMD ROCm).",
        OneOf(("auto", "cpu", "cuda")),
    )
    collective_timeout_s: float = doc(
        600.0,
        "A collective that waits longer than this ends the job with a message naming the rank and step, instead of "
        "hanging.",
        Range(0, open_low=True),
    )
    overwrite: bool = doc(
        False,
        "Start afresh in a job.output_dir that holds an earlier run's metrics but no checkpoint to resume from (its "
        "metrics.jsonl is replaced); without it such a start is refused.",
        Flag(),
    )


@dataclass
class Model:
    name: str = doc(
        "debug",
        "Preset: debug, debug-gpt, gpt-125m, gpt-1.4b, gpt-22b, gpt-175b, gpt-1t, llama3-1b, llama3-8b, llama3-70b, "
        "llama3-405b; mixtures of experts: debug-moe, mixtral-8x7b, mixtral-8x22b, qwen3-30b-a3b, qwen3-235b-a22b.",
        OneOf(preset_names),
    )
    n_layers: int = doc(0, "Override the preset's layer count (0 = keep).", Range(1, also=KEEP))
    dim: int = doc(0, "Override the preset's hidden size (0 = keep).", Range(1, also=KEEP))
    n_heads: int = doc(0, "Override the preset's query heads (0 = keep).", Range(1, also=KEEP))
    n_kv_heads: int = doc(0, "Override the preset's key/value heads (0 = keep).", Range(1, also=KEEP))
    ffn_dim: int = doc(0, "Override the preset's MLP width (0 = keep).", Range(1, also=KEEP))
    vocab_size: int = doc(
        0, "Override the preset's vocabulary size (0 = keep); must hold the tokenizer's ids.", Range(1, also=KEEP)
    )
    max_seq_len: int = doc(
        0,
        "Override the preset's longest sequence (0 = keep), e.g. 131072 for Llama 3.1's long-context training; sizes "
        "the rotary cache or learned position table.",
        Range(1, also=KEEP),
    )
    n_experts: int = doc(0, "Override an MoE preset's routed experts (0 = keep).", Range(1, also=KEEP))
    top_k: int = doc(0, "Override an MoE preset's experts per token (0 = keep).", Range(1, also=KEEP))
    mtp_modules: int = doc(
        -1,
        "DeepSeek-V3's multi-token prediction: modules trained beside the model, module k predicting the token k + 1 "
        "after the next from the previous depth's hidden state and token k's embedding, sharing the embedding and "
        "output head (-1 = the preset's, 0 = off). Training only: evaluation, generation and export use the main "
        "head; with data and expert parallelism only (no pp, cp or tp).",
        Range(0, also={-1: "keep the preset's"}),
    )
    mtp_loss_weight: float = doc(
        -1.0,
        "Weight of the multi-token prediction modules' mean loss in the training loss (-1 = the preset's, or "
        "DeepSeek-V3's 0.3 where the preset has no MTP).",
        Range(0, open_low=True, also={-1.0: "keep the preset's"}),
    )


PRESET_VALUE = {-1.0: "keep the preset's"}


@dataclass
class Moe:
    aux_loss_coef: float = doc(
        -1.0,
        "Weight of the Switch/Mixtral load-balancing loss E * sum_e f_e P_e in the training loss (0 = off, -1 = the "
        "preset's).",
        Range(0, also=PRESET_VALUE),
    )
    seq_aux_loss_coef: float = doc(
        -1.0,
        "Weight (alpha) of DeepSeek-V3's sequence-wise balance loss in the training loss: per sequence, sum_e f_e P_e "
        "with f_e = E / (top_k x seq_len) x the sequence's tokens choosing e and P_e the sequence's mean of the scores "
        "normalised to sum to one; averaged over sequences (DeepSeek-V3: 1e-4; 0 = off, -1 = the preset's).",
        Range(0, also=PRESET_VALUE),
    )
    bias_update_rate: float = doc(
        -1.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: each step every expert's selection bias moves by this much "
        "toward equal load (0 = off, -1 = the preset's).",
        Range(0, also=PRESET_VALUE),
    )
    capacity_factor: float = doc(
        -1.0,
        "Tokens an expert takes per step, as a multiple of an even share (tokens x top_k / experts); the rest are "
        "dropped and counted. 0 = dropless (every token reaches its top_k), -1 = the preset's.",
        Range(1, also={0.0: "dropless", **PRESET_VALUE}),
    )


@dataclass
class Data:
    path: str = doc(
        "",
        "Local file or folder (json, jsonl, txt, parquet). Empty with no `name`: the embedded default corpus (this "
        "Python's standard-library sources).",
        ExistingPath(
            "Point it at a json, jsonl, txt or parquet file or a folder of them, or leave it empty for the default "
            "corpus."
        ),
    )
    name: str = doc("", "Hugging Face hub dataset name (needs a network), e.g. allenai/c4.", Text())
    config_name: str = doc("", "Hub dataset configuration (the second argument of load_dataset), e.g. en.", Text())
    split: str = doc("train", "Dataset split.", Text(nonempty=True))
    text_field: str = doc("text", "Column holding the document text.", Text(nonempty=True))
    streaming: bool = doc(
        False, "Stream the dataset instead of loading it whole (hub datasets, large local ones).", Flag()
    )
    prepared: str = doc(
        "",
        "Train from token stores written by `trillion prepare-data --out DIR` (same data and tokenizer settings): "
        "DIR, or DIR:weight,DIR:weight,... blended by weight. Instead of data.path / data.name.",
        Text(),
    )
    shuffle: bool = doc(
        True, "data.prepared: a seeded permutation of the windows in every epoch; false keeps file order.", Flag()
    )
    lanes: int = doc(
        8,
        "Documents read side by side (data.path / data.name and the default corpus): lane j packs documents j, j+L, "
        "j+2L, ... of the seeded order into its own stream and window k of the run comes from lane k mod L, so "
        "consecutive windows come from different documents (at most the number of documents; 1 = one document after "
        "another). The evaluation set deals its documents over as many lanes.",
        POSITIVE,
    )


@dataclass
class Tokenizer:
    kind: str = doc(
        "byte",
        "byte (no files: UTF-8 bytes + EOS) | hf (a tokenizer.json) | tiktoken (a BPE ranks file).",
        OneOf(("byte", "hf", "tiktoken")),
    )
    path: str = doc(
        "",
        "tokenizer.json for hf, the .tiktoken ranks file for tiktoken.",
        ExistingPath(
            "Give the tokenizer.json (hf) or .tiktoken file (tiktoken), or use --tokenizer.kind=byte, which needs no "
            "files."
        ),
    )
    eos_token: str = doc(
        "", "End-of-document token text (hf, tiktoken); empty: the tokenizer's own EOS, or <|endoftext|>.", Text()
    )

    def check_relations(self) -> None:
        if self.kind != "byte" and not self.path:
            raise ConfigError(
                f"tokenizer.kind={self.kind} needs tokenizer.path (its tokenizer.json or .tiktoken file). "
                "Give --tokenizer.path, or use --tokenizer.kind=byte, which needs no files."
            )


@dataclass
class Training:
    steps: int = doc(200, "Optimizer steps of the whole run (the LR schedule follows it).", POSITIVE)
    global_batch_size: int = doc(8, "Sequences per optimizer step, summed over all data-parallel ranks.", POSITIVE)
    micro_batch_size: int = doc(
        8,
        "Sequences per forward/backward on one data-parallel rank; micro-batches per step = global / (micro * "
        "data-parallel ranks).",
        POSITIVE,
    )
    seq_len: int = doc(256, "Tokens per sequence (at most the model's max_seq_len).", POSITIVE)
    dtype: str = doc(
        "auto",
        "auto (bf16 on GPUs, fp32 on CPU) | bf16 | fp16 (dynamic loss scaling, as the paper) | fp32.",
        OneOf(("auto", "bf16", "fp16", "fp32")),
    )
    max_grad_norm: float = doc(1.0, "Clip the total gradient norm to this (0 = no clipping).", NONNEGATIVE)
    exit_interval: int = doc(
        0, "Stop cleanly (checkpoint, exit 0) after this many steps of this job (0 = run to `steps`).", NONNEGATIVE
    )
    exit_after_minutes: float = doc(
        0.0,
        "Stop cleanly (checkpoint, exit 0) once this job has run this long (0 = no limit); leave room for one save "
        "before the allocation ends.",
        NONNEGATIVE,
    )
    max_nonfinite_skips: int = doc(
        10,
        "A step with a non-finite loss or gradient norm is skipped (no update); stop with an error after this many in "
        "a row (0 = never stop).",
        NONNEGATIVE,
    )

    def check_relations(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}; micro-batches per step = global / micro. "
                f"Use e.g. --training.micro_batch_size={divisor_near(self.global_batch_size, self.micro_batch_size)}."
            )


@dataclass
class Optimizer:
    name: str = doc("adamw", "Optimizer; only adamw for now.", OneOf(("adamw",)))
    lr: float = doc(3e-3, "Peak learning rate.", NONNEGATIVE)
    beta1: float = doc(0.9, "AdamW beta1.", Range(0, 1, open_high=True))
    beta2: float = doc(0.95, "AdamW beta2.", Range(0, 1, open_high=True))
    eps: float = doc(1e-8, "AdamW epsilon.", Range(0, open_low=True))
    weight_decay: float = doc(
        0.1, "Decoupled weight decay of matrices (never of norms, biases and embeddings).", NONNEGATIVE
    )
    implementation: str = doc(
        "auto",
        "auto (fused on GPUs and CPUs) | fused | foreach | for-loop. Fused masks a non-finite step on the device; "
        "foreach and for-loop read the step's finite flag on the host every step.",
        OneOf(("auto", "fused", "foreach", "for-loop")),
    )


@dataclass
class LRSchedule:
    name: str = doc(
        "cosine",
        "cosine | linear | wsd (warmup-stable-decay) | constant; all after linear warmup.",
        OneOf(("cosine", "linear", "wsd", "constant")),
    )
    warmup_steps: int = doc(20, "Steps of linear warmup from 0 to the peak LR.", NONNEGATIVE)
    min_lr_ratio: float = doc(0.1, "Final LR as a fraction of the peak.", Range(0, 1))
    decay_ratio: float = doc(0.2, "wsd only: share of the steps spent in the final linear decay.", Range(0, 1))


ASYNC_MODES = ("disabled", "async")  # checkpoint.async_mode: the manager writes in the background when "async"


@dataclass
class Checkpoint:
    interval: int = doc(0, "Save every N steps (0 = only the final checkpoint).", NONNEGATIVE)
    keep_latest: int = doc(2, "Keep this many newest checkpoints (0 = keep all).", NONNEGATIVE)
    async_mode: str = doc(
        "disabled", "disabled | async: write in the background while training goes on.", OneOf(ASYNC_MODES)
    )
    initial_load: str = doc(
        "",
        "Start a new run from these weights: a checkpoint step directory or a Hugging Face folder (`trillion export` "
        "writes one); ignored when the run resumes.",
        ExistingPath("Give a checkpoint step directory or a Hugging Face folder (`trillion export` writes one)."),
    )
    save_final: bool = doc(True, "Save a checkpoint after the last step.", Flag())
    accept_data_change: bool = doc(
        False,
        "Resume although the data files changed since the checkpoint (added, removed or edited; detected from the "
        "fingerprint each checkpoint keeps): the saved data position then counts into the new corpus.",
        Flag(),
    )


@dataclass
class Metrics:
    log_freq: int = doc(10, "Log metrics every N steps (and the first and last).", POSITIVE)
    peak_tflops: float = doc(
        0.0, "Peak dense TFLOP/s per device for MFU (0 = look the device up; unknown devices get no MFU).", NONNEGATIVE
    )


@dataclass
class Logging:
    wandb: bool = doc(
        True, "Write a Weights & Biases run: online when a project or API key is configured, offline otherwise.", Flag()
    )
    wandb_project: str = doc(
        "", "W&B project (or WANDB_PROJECT); setting it, or WANDB_API_KEY, makes the run online.", Text()
    )
    wandb_entity: str = doc("", "W&B entity (team or user).", Text())
    wandb_run_name: str = doc("", "W&B run name (default: the output directory's name).", Text())
    wandb_group: str = doc("", "W&B group (or WANDB_RUN_GROUP), e.g. one scaling study.", Text())
    wandb_tags: str = doc("", "Comma-separated W&B tags (or WANDB_TAGS).", Text())
    wandb_init_timeout_s: float = doc(
        30.0,
        "Give up reaching the W&B server after this long and write the run offline instead.",
        Range(0, open_low=True),
    )
    tensorboard: bool = doc(
        False, "Also write TensorBoard event files under <output_dir>/tensorboard (needs `tensorboard`).", Flag()
    )
    progress_bar: str = doc(
        "auto", "auto (a live bar on a terminal, log lines otherwise) | bar | lines.", OneOf(("auto", "bar", "lines"))
    )


def _names(**rule) -> str:
    """The schedules whose table entries match `rule`, e.g. placement="v"."""
    return ", ".join(s.name for s in SCHEDULES.values() if all(getattr(s, k) == v for k, v in rule.items()))


SCHEDULE_DOC = (
    f"Pipeline schedule from torch.distributed.pipelining: {' | '.join(SCHEDULES)}; each has a parity test. "
    f"All but {_names(min_microbatches='')} need at least pp micro-batches per step, "
    f"{_names(min_microbatches='stages')} "
    f"2 pp. The zero-bubble ones ({_names(split_backward=True)}) split the backward and refuse compile."
)


@dataclass
class Parallel:
    dp_replicate: int = doc(1, "Data-parallel replicas (DDP/HSDP outer dimension).", POSITIVE)
    dp_shard: int = doc(
        -1,
        "Sharded data parallelism (FSDP2) degree; -1 = what the world size leaves.",
        Range(1, also={-1: "what the world size leaves"}),
    )
    dp_shard_mode: str = doc(
        "zero3", f"{' | '.join(ZERO_MODES)}: what FSDP keeps sharded between uses.", OneOf(tuple(ZERO_MODES))
    )
    tp: int = doc(1, "Tensor-parallel degree (keep inside a node).", POSITIVE)
    ep: int = doc(
        1,
        "Expert-parallel degree (MoE models): the routed experts are split over ep ranks taken from the "
        "data-parallel ones (ep divides dp_shard x cp and the expert count); tokens reach them by all-to-all.",
        POSITIVE,
    )
    pp: int = doc(1, "Pipeline-parallel degree.", POSITIVE)
    pp_schedule: str = doc("1F1B", SCHEDULE_DOC, OneOf(tuple(SCHEDULES), case_sensitive=False))
    pp_virtual_stages: int = doc(
        0,
        f"Pipeline stages per rank for looped schedules ({_names(placement='looped')}); 0 = {DEFAULT_VIRTUAL_STAGES}. "
        f"One for {_names(placement='single')}; two for {_names(placement='v')}.",
        Range(1, also={0: "the schedule's default"}),
    )
    pp_layers_per_stage: int = doc(
        0,
        "Transformer layers on each pipeline stage (0 = split automatically, balanced, counting the embedding and the "
        "output as one layer each). First + (stages - 2) x this + last must equal model.n_layers; stages = pp x "
        "virtual stages.",
        Range(1, also={0: "automatic"}),
    )
    pp_first_stage_layers: int = doc(
        -1,
        "Transformer layers on the first pipeline stage, beside the embedding (-1 = pp_layers_per_stage - 1, as the "
        "embedding counts as a layer; automatic when that is 0 too). 0 = the embedding alone.",
        Range(0, also={-1: "from pp_layers_per_stage"}),
    )
    pp_last_stage_layers: int = doc(
        -1,
        "Transformer layers on the last pipeline stage, beside the final norm and output (-1 = pp_layers_per_stage - "
        "1; automatic when that is 0 too). 0 = the output alone.",
        Range(0, also={-1: "from pp_layers_per_stage"}),
    )
    cp: int = doc(
        1,
        "Context-parallel degree: each rank holds 1/cp of every sequence (a head and a tail chunk, balanced for "
        "causal attention); training.seq_len must divide by 2 cp (x tp).",
        POSITIVE,
    )
    activation_checkpoint: str = doc(
        "none",
        f"{' | '.join(CHECKPOINT_MODES)} | selective:N (every N-th block): which blocks recompute their activations "
        f"in backward (selective: every {SELECTIVE_EVERY}nd; selective:op: every block, saving matmul outputs).",
        OneOf((*CHECKPOINT_MODES, "selective:N")),
    )


@dataclass
class Kernels:
    attention: str = doc(
        "auto",
        "auto (triton on GPUs, sdpa on CPU) | triton (our flash attention; falls back to sdpa, saying why, where "
        "Triton cannot run) | sdpa (PyTorch scaled_dot_product_attention) | eager (plain reference).",
        OneOf(attention_impls, extra=("auto",)),
    )
    norm: str = doc(
        "auto",
        "auto (triton on GPUs, torch on CPU) | triton (fused RMSNorm/LayerNorm kernels) | torch (PyTorch's modules).",
        OneOf(norm_impls, extra=("auto",)),
    )
    grouped_gemm: str = doc(
        "auto",
        "The routed experts' matmuls: auto (torch where it runs, else loop) | torch (torch._grouped_mm: CUDA sm90+ "
        "in bf16, CPU with rows of 16-byte multiples) | loop (one matmul per expert).",
        OneOf(grouped_gemm_impls),
    )


@dataclass
class Compile:
    enabled: bool = doc(False, "torch.compile each transformer block.", Flag())


@dataclass
class Float8:
    enabled: bool = doc(
        False,
        "Train the blocks' linears in float8 with torchao (`pip install torchao`): GPUs with float8 matrix units "
        "(NVIDIA sm89 and later: L40S, H100, H200, B200; AMD gfx942 and later: MI300X); refused on A100 and MI250X, "
        "and on a CPU without float8.emulate. The output projection, routers and linears whose dimensions are not "
        "multiples of 16 stay in high precision, and so do the master weights and checkpoints. Pair with "
        "compile.enabled: torchao's casts are fused only under torch.compile.",
        Flag(),
    )
    recipe: str = doc(
        "tensorwise",
        "tensorwise (one scale per tensor: fastest; FSDP and TP all-gather in float8) | rowwise (one power-of-two "
        "scale per row: more accurate, slower) | rowwise_with_gw_hp (rowwise, weight gradients in high precision).",
        OneOf(tuple(FLOAT8_RECIPES)),
    )
    emulate: bool = doc(
        False,
        "Emulate float8: the same quantisation with high-precision matmuls; runs anywhere, a CPU included, but is "
        "not faster (for tests and debugging).",
        Flag(),
    )
    fsdp_all_gather: str = doc(
        "auto",
        "auto | on | off: FSDP2 all-gathers the float8 weights (half bf16's bytes), their scales precomputed once "
        "per step; torchao supports it for tensorwise only (auto: on for tensorwise under FSDP, off otherwise).",
        OneOf(FLOAT8_ALL_GATHER),
    )

    def check_relations(self) -> None:
        if self.enabled:
            float8_recipe(self.recipe, self.fsdp_all_gather)


@dataclass
class Profiling:
    enabled: bool = doc(
        False, "Write torch.profiler traces (Chrome/Perfetto JSON) per rank under <output_dir>/profiles.", Flag()
    )
    wait: int = doc(5, "Profiler schedule: steps to skip before each recording.", NONNEGATIVE)
    warmup: int = doc(2, "Profiler schedule: steps recorded and thrown away (the profiler's own warm-up).", NONNEGATIVE)
    active: int = doc(3, "Profiler schedule: steps recorded into one trace.", POSITIVE)
    repeat: int = doc(1, "Profiler schedule: how many traces (0 = until the end).", NONNEGATIVE)
    memory_snapshot: bool = doc(
        False, "GPUs: record allocations; write a snapshot at memory_snapshot_step and on out-of-memory.", Flag()
    )
    memory_snapshot_step: int = doc(3, "Step after which the memory snapshot is written.", POSITIVE)


@dataclass
class Eval:
    interval: int = doc(
        50, "Evaluate the held-out loss every N steps, before the first step and after the last (0 = off).", NONNEGATIVE
    )
    steps: int = doc(
        16,
        "Batches per evaluation: the same first eval.steps x eval.batch_size windows of the held-out set every time.",
        NONNEGATIVE,
    )
    batch_size: int = doc(
        0,
        "Sequences per evaluation batch, summed over data-parallel ranks (0 = training.global_batch_size).",
        NONNEGATIVE,
    )
    held_out: float = doc(
        0.01,
        "Share of the training documents held out for evaluation (and never trained on), chosen by a hash of each "
        "document's text: the same documents whatever the seed, order or ranks. Unused with eval.path or eval.name.",
        Range(0, 1, open_high=True),
    )
    path: str = doc(
        "",
        "A separate evaluation set: local file or folder (json, jsonl, txt, parquet), read with data.text_field. Then "
        "no training document is held out.",
        ExistingPath("Point it at a json, jsonl, txt or parquet file or a folder of them, or leave it empty."),
    )
    name: str = doc(
        "", "A separate evaluation set on the Hugging Face hub (needs a network), with data.config_name.", Text()
    )
    split: str = doc(
        "", "Split of eval.path or eval.name (empty: train for local files, validation for hub datasets).", Text()
    )

    def check_relations(self) -> None:
        if self.path and self.name:
            raise ConfigError(
                f"eval.path={self.path!r} and eval.name={self.name!r} both name an evaluation set; keep one."
            )
        if self.interval and not self.steps:
            raise ConfigError(
                f"eval.interval={self.interval} evaluates on eval.steps=0 batches; give --eval.steps=16 "
                "(or --eval.interval=0 to turn evaluation off)."
            )
        if self.interval and not (self.path or self.name or self.held_out):
            raise ConfigError(
                f"eval.interval={self.interval} needs text to evaluate on: hold some documents out "
                "(--eval.held_out=0.01) or give a separate set (--eval.path=FILE), or set --eval.interval=0."
            )


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: Moe = field(default_factory=Moe)
    data: Data = field(default_factory=Data)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    logging: Logging = field(default_factory=Logging)
    parallel: Parallel = field(default_factory=Parallel)
    kernels: Kernels = field(default_factory=Kernels)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)
    eval: Eval = field(default_factory=Eval)


def validate_config(config: Config) -> None:
    """Every field's declared check, then each section's relations; the first problem is raised
    as a ConfigError naming the setting, its accepted values and its default."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            value, check = getattr(values, f.name), f.metadata["check"]
            problem = check.problem(value) if check is not None else None
            if problem:
                raise ConfigError(
                    f"{section.name}.{f.name}={value!r} {problem}. The default is {f.default!r}; "
                    f"`trillion train --help` documents every setting."
                )
        if hasattr(values, "check_relations"):
            values.check_relations()


def divisor_near(n: int, target: int) -> int:
    """The divisor of n closest to target: the nearest valid value to suggest in a fix."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - target))


def _coerce(value, kind, where: str):
    """Turn a TOML value or a CLI string into the field's type, or say what was expected."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
        else:
            try:
                return kind(text)
            except ValueError:
                if kind is int and _is_integral_float(text):  # 2e5 steps
                    return int(float(text))
        raise ConfigError(f"{where}={value!r} is not a valid {kind.__name__}. Give e.g. {where}={_example(kind)}.")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}={value!r} is not a valid {kind.__name__}. Give e.g. {where}={_example(kind)}.")
    return value


def _is_integral_float(text: str) -> bool:
    try:
        return float(text).is_integer()
    except ValueError:
        return False


def _example(kind) -> str:
    return {int: "8", float: "0.001", bool: "true", str: '"text"'}[kind]


def _set(config: Config, key: str, value) -> None:
    section_name, _, field_name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections or not field_name:
        raise ConfigError(f"Unknown config key {key!r}. Sections: {', '.join(sections)}; see `trillion train --help`.")
    section = getattr(config, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if field_name not in fields:
        raise ConfigError(
            f"Unknown config key {key!r}. Fields of [{section_name}]: {', '.join(fields)}; see `trillion train --help`."
        )
    kind = typing.get_type_hints(type(section))[field_name]
    setattr(section, field_name, _coerce(value, kind, f"--{key}"))


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then `--section.field=value` overrides, in that order."""
    config = Config()
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                f"--config {path}: no such file. Give the path of a TOML file, e.g. experiments/configs/debug.toml."
            )
        try:
            table = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path} is not valid TOML: {error}.") from None
        for section_name, section in table.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: {section_name!r} must be a [section] table; see `trillion train --help`.")
            for field_name, value in section.items():
                _set(config, f"{section_name}.{field_name}", value)
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(
                f"Cannot read the argument {item!r}: write overrides as --section.field=value, e.g. "
                "--training.steps=100."
            )
        key, _, value = item[2:].partition("=")
        _set(config, key, value)
    validate_config(config)
    return config


def to_toml(config: Config) -> str:
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for name, value in dataclasses.asdict(getattr(config, section.name)).items():
            if isinstance(value, bool):
                lines.append(f"{name} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f"{name} = {_toml_string(value)}")
            else:
                lines.append(f"{name} = {value!r}")
        lines.append("")
    return "\n".join(lines)


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def help_text() -> str:
    lines = ["Configuration (TOML sections, or --section.field=value on the command line):", ""]
    for section in dataclasses.fields(Config):
        lines.append(f"[{section.name}]")
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{section.name}.{f.name}  ({hints[f.name].__name__}, default {default!r})")
            lines.append(f"      {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)
