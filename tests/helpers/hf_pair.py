"""The reference of the Hugging Face parity tests: our model and transformers' with the same weights, in float64."""

import torch

from trillion.models import Transformer
from trillion.models.args import ModelArgs
from trillion.models.hf import hf_config, to_hf_state_dict


def ours_and_theirs_float64(args: ModelArgs, hf_class: str, perturbed: tuple[str, ...] = ("norm",)):
    """Our model (seed 3; every tensor whose name holds one of `perturbed` moved off its initial value, so a
    misplaced one would show) and transformers' `hf_class` built from hf_config(args), both float64, eval mode."""
    import transformers

    ours = Transformer(args)
    ours.init_weights(seed=3)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in ours.state_dict(keep_vars=True).items():
            if any(part in name for part in perturbed):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    ours = ours.double().eval()
    config = hf_config(args)
    config._attn_implementation, config._experts_implementation = "eager", "eager"  # float64: no grouped_mm
    theirs = getattr(transformers, hf_class)(config).double().eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), args, layout="fused"), strict=True)
    return ours, theirs
