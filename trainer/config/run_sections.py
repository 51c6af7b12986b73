"""The sections of the run's course: [job], [training], [optimizer], [lr_schedule], [checkpoint]."""

from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.parallel.muon.matrices import MAX_NEWTON_SCHULZ_STEPS, MOMENTUM, NEWTON_SCHULZ_STEPS
from trillion.parallel.planner.goodput import MTBF_HOURS_PER_GPU
from trillion.trainer.config.checks import CreatableDir, ExistingPath, Flag, OneOf, Range, Text
from trillion.trainer.config.fields import NONNEGATIVE, POSITIVE, divisor_near, doc


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
    world_size: int = doc(
        0,
        "The processes the run is laid out for (0 = whatever the launcher starts). `trillion plan --config-out` writes "
        "it: `trillion estimate --config FILE` simulates that many ranks, and `trillion train` refuses a launch of "
        "another count.",
        Range(1, also={0: "the launcher's"}),
    )
    hardware: str = doc(
        "",
        "The hardware profile the run is planned for (a name `trillion plan --hardware` takes, or a profile file; "
        "'' = none): `trillion estimate` compares each rank's memory with its device and, with "
        "parallel.ranks_per_node=0, lays the ranks out on its nodes.",
        Text(),
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
    name: str = doc(
        "adamw",
        "adamw | muon: Muon (Nesterov momentum, Newton-Schulz orthogonalized) for the hidden matrices, AdamW (the "
        "settings below) for embeddings, output head, norms and biases; its update matches AdamW's RMS, so lr, "
        "weight_decay and the schedule carry over.",
        OneOf(("adamw", "muon")),
    )
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
    state_dtype: str = doc(
        "float32",
        "float32 | bfloat16: the dtype AdamW keeps its two moments in (bfloat16: 4 bytes a parameter instead of 8, "
        "as DeepSeek-V3 trained; the step still computes in float32, parallel/adamw_states.py); with Muon, its AdamW "
        "part's. bfloat16 runs its own step, not the fused one.",
        OneOf(("float32", "bfloat16")),
    )
    ema_decay: float = doc(
        0.0,
        "The parameters' exponential moving average, kept in pinned host memory as DeepSeek-V3 kept it: after each "
        "step ema = decay * ema + (1 - decay) * parameter, from each rank's own shard (no gathering), copied off the "
        "device without waiting for it; saved in checkpoints, and `trillion export --weights ema` writes it. "
        "0 = off; otherwise below 1 (0.999 averages about the last 1000 steps).",
        Range(0, 1, open_high=True),
    )
    momentum: float = doc(MOMENTUM, "Muon: the hidden matrices' Nesterov momentum.", Range(0, 1, open_high=True))
    newton_schulz_steps: int = doc(
        NEWTON_SCHULZ_STEPS,
        "Muon: quintic Newton-Schulz steps per orthogonalization (its coefficients are tuned for 5; each step is three "
        "matrix products).",
        Range(1, MAX_NEWTON_SCHULZ_STEPS),
    )
    newton_schulz_dtype: str = doc(
        "auto",
        "Muon: auto (bfloat16 on GPUs, float32 on CPUs) | bfloat16 | float32; also what the matrices travel in.",
        OneOf(("auto", "bfloat16", "float32")),
    )
    qk_clip: float = doc(
        0.0,
        "MuonClip's tau (Kimi K2 trained with 100): after each step, an attention head whose largest logit passed it "
        "has its query and key weights scaled back to it; logs attention/max_logit. 0 = off.",
        NONNEGATIVE,
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
    load_step: int = doc(
        0,
        "Resume from this step's checkpoint instead of the newest intact one (0 = the newest): to go back past "
        "checkpoints a diverging run wrote. The later ones are set aside as abandoned-step-* (kept, never loaded or "
        "pruned); once the run has saved past that step, the same command resumes from its newest checkpoint.",
        NONNEGATIVE,
    )
    save_final: bool = doc(True, "Save a checkpoint after the last step.", Flag())
    mtbf_hours_per_gpu: float = doc(
        float(round(MTBF_HOURS_PER_GPU)),
        "Mean time between failures of one GPU, in hours (default: Llama 3's 419 failures in 54 days on 16,384 "
        "H100s, arXiv 2407.21783). After the first periodic save the run warns when checkpoint.interval is more than "
        "twice off the Young/Daly optimum for its GPUs, save time and step time (0 = no advice).",
        NONNEGATIVE,
    )
    accept_data_change: bool = doc(
        False,
        "Resume although the data files changed since the checkpoint (added, removed or edited; detected from the "
        "fingerprint each checkpoint keeps): the saved data position then counts into the new corpus.",
        Flag(),
    )
