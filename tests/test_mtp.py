"""DeepSeek-V3's multi-token prediction (models/mtp.py, the loss in parallel/forward_backward.py) against
the paper's section 2.2 written out here in float64 from the model's weights: the trunk, the MTP module
(enorm, hnorm, eh_proj, its block, its norm, the shared head) and both losses, values and every gradient
(the shared embedding and head included); evaluation uses the main head only; a short run lowers both
losses, export leaves the modules out and an import starts them afresh; bad settings and layouts are
refused, naming the fix."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.flags import TINY
from tests.test_evaluate import corpus, evaluator  # noqa: F401 (corpus: the fixture evaluator reads)
from trillion.models import PRESETS, Transformer, parts
from trillion.models.mtp import lookahead_labels, lookahead_tokens
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import IGNORE_INDEX, MicroBatchLoop, with_lookahead
from trillion.parallel.layout import layout_on
from trillion.trainer.cli.main import main

ARGS = dataclasses.replace(
    PRESETS["debug"], n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=320, max_seq_len=16
)
MTP = dataclasses.replace(ARGS, mtp_modules=1, mtp_loss_weight=0.3)
EPS = ARGS.norm_eps


def build(args, dtype=torch.float64, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.to(dtype)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotate(x):
    """Rotary positions, half-split pairs (dimension j with j + head_dim / 2), position p at angle p / theta^(2j/d)."""
    seq, dim = x.shape[-2], x.shape[-1]
    angle = torch.arange(seq, dtype=torch.float64)[:, None] / ARGS.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float64) / dim
    )
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def block(x, w: dict, prefix: str):
    """A pre-norm block: causal grouped-query attention with rotary positions, then a SwiGLU feed-forward."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = ARGS.n_heads, ARGS.kv_heads, ARGS.dim // ARGS.n_heads

    def split(t, n):
        return t.view(batch, seq, n, head_dim).transpose(1, 2)

    a = rms_norm(x, w[prefix + "attention_norm.weight"])
    q = rotate(split(a @ w[prefix + "attention.wq.weight"].T, heads))
    k = rotate(split(a @ w[prefix + "attention.wk.weight"].T, kv_heads)).repeat_interleave(heads // kv_heads, dim=1)
    v = split(a @ w[prefix + "attention.wv.weight"].T, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    x = x + attended @ w[prefix + "attention.wo.weight"].T
    f = rms_norm(x, w[prefix + "ffn_norm.weight"])
    hidden = F.silu(f @ w[prefix + "feed_forward.w1.weight"].T) * (f @ w[prefix + "feed_forward.w3.weight"].T)
    return x + hidden @ w[prefix + "feed_forward.w2.weight"].T


def reference_losses(w: dict, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss), each the summed cross-entropy over the trunk's target count T (the paper's eq. 25)."""
    inputs, labels = window[:, :-1], window[:, 1:]
    embed, head = w["tok_embeddings.weight"], w["output.weight"]
    h = rms_norm(block(embed[inputs], w, "layers.0."), w["norm.weight"])  # the trunk's output representation
    count = labels.numel()
    main = F.cross_entropy((h @ head.T).flatten(0, 1), labels.flatten(), reduction="sum")
    # depth 1: position i sees the trunk's h_i and token i+1's embedding, and predicts token i+2
    joined = torch.cat(
        [rms_norm(embed[inputs[:, 1:]], w["mtp.1.enorm.weight"]), rms_norm(h[:, :-1], w["mtp.1.hnorm.weight"])], -1
    )
    h1 = block(joined @ w["mtp.1.eh_proj.weight"].T, w, "mtp.1.block.")
    logits = rms_norm(h1, w["mtp.1.norm.weight"]) @ head.T
    ahead = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    return main / count, ahead / count


def test_mtp_loss_and_every_gradient_equal_a_float64_reference():
    model = build(MTP)
    window = torch.randint(0, ARGS.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    runner = MicroBatchLoop(model, ahead_weight=MTP.mtp_loss_weight, lookahead=1)
    tokens = torch.tensor(3 * 12)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stacked = with_lookahead([(window[:, :-1], window[:, 1:])], 1)  # as the training step stacks the labels
    loss = runner.forward_backward(stacked, tokens, torch.autocast("cpu", enabled=False), scaler)
    weights = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    main, ahead = reference_losses(weights, window)
    (main + MTP.mtp_loss_weight * ahead).backward()
    # the logged losses (the runner sums them in float32): the trunk's, and the MTP modules' apart
    torch.testing.assert_close(loss.double(), main.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(runner.ahead_loss.double(), ahead.detach(), rtol=1e-6, atol=0)
    for name, param in model.named_parameters():  # token_loss takes the cross-entropy in float32: 1e-7 relative
        torch.testing.assert_close(param.grad, weights[name].grad, rtol=1e-5, atol=1e-8, msg=name)
    # the shared embedding and head take the MTP loss's gradient too: without it theirs differ
    model.zero_grad()
    MicroBatchLoop(model).forward_backward(
        [(window[:, :-1], window[:, 1:])], tokens, torch.autocast("cpu", enabled=False), scaler
    )
    for shared in ("tok_embeddings.weight", "output.weight"):
        difference = (model.get_parameter(shared).grad - weights[shared].grad).abs().max()
        assert difference > 1e-4 * weights[shared].grad.abs().max(), shared


def test_evaluation_and_generation_use_the_main_head_only(corpus):  # noqa: F811 (the fixture)
    found = evaluator(corpus, "--eval.held_out=0.3", "--eval.steps=2")
    with_mtp, without = build(MTP, torch.float32), build(ARGS, torch.float32)
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    dims, autocast = ParallelDims(world_size=1), torch.autocast("cpu", enabled=False)
    result = found.evaluate(with_mtp, dims, autocast)
    assert result == found.evaluate(without, dims, autocast)
    with torch.no_grad():
        for param in with_mtp.mtp.parameters():
            param.normal_()
    assert found.evaluate(with_mtp, dims, autocast) == result
    tokens = torch.randint(0, ARGS.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(with_mtp(tokens), without(tokens), rtol=0, atol=0)


def depth_logits(model, window: torch.Tensor, depths: int) -> tuple[torch.Tensor, ...]:
    """The model's (logits, each depth's) of a window (batch, seq + 1), the depths' tokens stacked as in training."""
    ahead = lookahead_tokens(lookahead_labels(window[:, 1:], depths, IGNORE_INDEX))
    return model(window[:, :-1], ahead=ahead)


@pytest.mark.parametrize("modules", [1, 2])
def test_each_depth_predicts_one_token_further_from_earlier_tokens_only(modules):
    model = build(dataclasses.replace(ARGS, mtp_modules=modules, mtp_loss_weight=0.3), torch.float32)
    logits, *ahead = depth_logits(model, torch.randint(0, ARGS.vocab_size, (2, 11)), modules)
    assert logits.shape == (2, 10, ARGS.vocab_size)
    assert [a.shape for a in ahead] == [(2, 10, ARGS.vocab_size)] * modules  # the trunk's length (models/mtp.py)
    # causal: depth k's position i reads tokens 0..i+k only (it predicts token i+k+1); change tokens 6.. and
    # positions up to 5-k stay, position 6-k moves
    window = torch.randint(0, ARGS.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    changed = window.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % ARGS.vocab_size
    with torch.no_grad():
        before, after = depth_logits(model, window, modules)[1:], depth_logits(model, changed, modules)[1:]
    for depth, (b, a) in enumerate(zip(before, after), start=1):
        torch.testing.assert_close(a[:, : 6 - depth], b[:, : 6 - depth], rtol=0, atol=0)
        assert not torch.allclose(a[:, 6 - depth], b[:, 6 - depth]), depth


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_with_mtp_lowers_both_losses_export_leaves_it_out_and_import_starts_it(tmp_path, caplog):
    from safetensors import safe_open

    out, hf = tmp_path / "run", tmp_path / "hf"
    caplog.set_level("INFO", logger="trillion")
    flags = [*TINY, "--model.mtp_modules=1", "--training.steps=8", "--eval.interval=8", "--eval.steps=1"]
    assert main(["train", *flags, f"--job.output_dir={out}"]) == 0
    trained = [r for r in records(out) if "loss" in r]
    assert all("mtp_loss" in r for r in trained)
    for key in ("loss", "mtp_loss"):
        first, last = (sum(r[key] for r in rows) / 3 for rows in (trained[:3], trained[-3:]))
        assert last < first - 0.3, (key, first, last)
    assert not any("mtp_loss" in r for r in records(out) if "eval_loss" in r and "loss" not in r)
    assert f"mtp {trained[-1]['mtp_loss']:.4f}" in caplog.text  # in the console line too
    assert main(["export", "--checkpoint", str(out), "--format", "hf", str(hf)]) == 0
    with safe_open(str(hf / "model.safetensors"), "pt") as exported:
        names = list(exported.keys())
    assert names and not any("mtp" in name or "layers.1." in name for name in names)
    assert "leaves out the 13 multi-token prediction tensors" in caplog.text
    # and a run with MTP starts from the exported folder, its module from its initial values
    again = ["train", *flags, "--training.steps=1", f"--checkpoint.initial_load={hf}", f"--job.output_dir={tmp_path}/b"]
    assert main(again) == 0


@pytest.mark.parametrize(
    "flags, named",
    [
        (
            ["--model.mtp_loss_weight=0.5"],
            ("model.mtp_loss_weight=0.5 does nothing", "multi-token prediction modules train", "--model.mtp_modules=1"),
        ),
        (["--model.mtp_modules=1", "--model.mtp_loss_weight=0"], ("model.mtp_loss_weight=0.0", "above 0")),
        (
            ["--moe.seq_aux_loss_coef=1e-4"],
            ("moe.seq_aux_loss_coef=0.0001 does nothing", "routed experts", "--model.name=debug-moe"),
        ),
    ],
)
def test_bad_mtp_settings_exit_2_naming_the_setting(flags, named, tmp_path, capsys):
    argv = ["train", *TINY, "--training.steps=1", "--eval.interval=0", *flags, f"--job.output_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 2 and all(fragment in err for fragment in named), err


@pytest.mark.parametrize(
    "layout",
    [{"pp": 2}, {"cp": 2}, {"tp": 2}, {"pp": 2, "pp_schedule": '"ZBVZeroBubble"'}],
)
def test_every_layout_takes_mtp_a_v_schedule_included(layout, tmp_path, capsys):
    """Through `trillion estimate` on fake ranks: the layout is checked as `trillion train` checks it. A V-shaped
    schedule puts both ends on one rank, the last stage's embedding copy beside the first stage's embedding
    (parallel/pipeline_ahead.py), as DeepSeek's DualPipe places them."""
    config = tmp_path / "run.toml"
    parallel = "\n".join(f"{axis} = {degree}" for axis, degree in {**layout, "dp_shard": 2}.items())
    training = "[training]\nglobal_batch_size = 8\nmicro_batch_size = 1\nseq_len = 64\n"
    config.write_text(f'[model]\nname = "debug"\nmtp_modules = 1\n\n[parallel]\n{parallel}\n\n{training}')
    code = main(["estimate", "--config", str(config), "--world-size", "4", "--no-measure", "--model.n_layers=2"])
    assert code == 0, capsys.readouterr().err


def test_data_and_expert_parallelism_run_mtp_and_every_layout_the_sequence_wise_loss():
    args = dataclasses.replace(PRESETS["debug-moe"], mtp_modules=1, mtp_loss_weight=0.3)
    assert not parts.layout_refusal(args, layout_on(4, dp_replicate=2, dp_shard=2, ep=2))
    per_sequence = dataclasses.replace(args, mtp_modules=0, moe=dataclasses.replace(args.moe, seq_aux_loss_coef=1e-4))
    for layout in ({"tp": 2}, {"cp": 2}, {"pp": 2}):  # cp: its statistics summed over the cp ranks (test_ep_parity)
        assert not parts.layout_refusal(per_sequence, layout_on(4, dp_shard=2, **layout))
