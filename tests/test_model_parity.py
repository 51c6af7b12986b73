"""Our model against Hugging Face transformers (an independent implementation): same weights,
same logits and loss, fp32 on CPU, for both families."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trillion.models import PRESETS, Transformer
from trillion.models.hf import hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "preset, hf_class, overrides",
    [
        ("debug", "LlamaForCausalLM", {}),
        ("debug", "LlamaForCausalLM", {"n_kv_heads": 2, "rope_theta": 500000.0}),  # grouped-query, Llama 3 theta
        ("debug-gpt", "GPT2LMHeadModel", {}),
    ],
)
def test_logits_and_loss_match_transformers(preset, hf_class, overrides):
    args = dataclasses.replace(PRESETS[preset], n_layers=2, max_seq_len=64, **overrides)
    ours = Transformer(args)
    ours.init_weights(seed=3)
    with torch.no_grad():  # non-trivial norm weights and biases, so a misplaced one would show
        for name, param in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    reference = getattr(transformers, hf_class)(hf_config(args)).eval()
    missing, unexpected = reference.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=False)
    assert not unexpected and all("rotary" in k or "attn.bias" in k or "masked_bias" in k for k in missing), missing

    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    labels = tokens[:, 1:]
    ours_loss = F.cross_entropy(actual[:, :-1].flatten(0, 1), labels.flatten())
    with torch.no_grad():
        reference_loss = reference(tokens, labels=tokens).loss
    torch.testing.assert_close(ours_loss, reference_loss, atol=1e-5, rtol=1e-5)
