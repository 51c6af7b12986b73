"""What every section file declares its fields with: `doc(default, text, check)`, the ranges they
share, and the tables of choices made in lower layers (read when a value is checked or help is shown,
so `trillion plan` reads configs without importing torch)."""

from dataclasses import field

from trillion.trainer.config.checks import Check, Range


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


def permutation_impls() -> tuple:
    from trillion.kernels.permute import PERMUTE_IMPLS

    return PERMUTE_IMPLS


def doc(default, text: str, check: Check | None = None):
    """A dataclass field with a default, the help text `--help` shows and the check of its values
    (tests/test_config_validation.py fails for a field declared without one)."""
    return field(default=default, metadata={"doc": text, "check": check})


POSITIVE, NONNEGATIVE, KEEP = Range(1), Range(0), {0: "keep the preset's"}
PRESET_VALUE = {-1.0: "keep the preset's"}


def divisor_near(n: int, target: int) -> int:
    """The divisor of n closest to target: the nearest valid value to suggest in a fix."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - target))
