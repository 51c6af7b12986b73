"""The real side of the estimate's exactness checks: one rank of a gloo run of a layout, built with
the trainer's own functions, one real optimizer step, then the bytes it actually holds."""
import json

import torch
import torch.nn.functional as F

from models import Transformer
from parallel.estimate import storage_bytes
from parallel.estimate_activations import measure_activations
from parallel.parallelize import parallelize
from parallel.tensor_parallel import apply_tensor_parallel, loss_context
from parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.config import load_config
from trainer.launch import LaunchEnv
from trainer.optim import build_optimizer
from trainer.train import build_model_args, build_parallel_dims


def measure_rank(rank: int, world_size: int, overrides: list, out_path: str) -> None:
    config = load_config(None, overrides)
    env = LaunchEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    args = build_model_args(config, 0)
    dims = build_parallel_dims(config, env, args)
    t = config.training
    micro = min(t.micro_batch_size, t.global_batch_size // dims.dp_size)
    torch.manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (micro, t.seq_len + 1))

    # 1. the real layout (TP + AC + FSDP2) and a real AdamW step: parameters, gradients, optimizer state
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims, dp_shard_mode=config.parallel.dp_shard_mode,
                activation_checkpoint=config.parallel.activation_checkpoint)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = build_optimizer(model, config.optimizer, "cpu")
    logits = model(tokens[:, :-1])
    with loss_context(dims.tp_enabled):
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1), reduction="sum").backward()
    optimizer.step()
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    record = {"parameters": storage_bytes(params), "gradients": storage_bytes([p.grad for p in params]),
              "optimizer": storage_bytes(states)}

    # 2. activations on real tensors: the same TP plan and checkpointing (FSDP does not change them)
    plain = Transformer(args)
    plain.init_weights(0)
    if dims.tp_enabled:
        apply_tensor_parallel(plain, dims.tp_mesh)
    apply_activation_checkpointing(plain, config.parallel.activation_checkpoint)
    record["activations"], _ = measure_activations(plain, args.vocab_size, micro, t.seq_len, dims.tp_enabled, "cpu")
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(record, f)
