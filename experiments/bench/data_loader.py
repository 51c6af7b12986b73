"""What data costs: `trillion prepare-data` throughput, and one rank's loader from a token store
against the on-the-fly loader at data-parallel degrees 1, 8 and 64.

    python experiments/bench/data_loader.py            # the default corpus (about 31M bytes), a few minutes
    python experiments/bench/data_loader.py --smoke    # seconds, for the test suite

prepare: the wall time of `prepare()` (listing, worker start-up, tokenizing, joining and hashing
the store) and the CPU time of all its processes (on a busy machine the CPU time shows what the
workers cost when the wall time cannot) on the default corpus with 1 and 2 workers, for the byte tokenizer and for a BPE
tokenizer trained here with the `tokenizers` library on part of the same corpus (no network).

loader: simulated ranks: in one process, the loader of rank 0 of D (and of rank D - 1) is built
as `trillion train` builds it and timed per global batch of G sequences of seq_len tokens: the
median of repeated batches after a warm-up one (experiments/bench/timing.py). The on-the-fly
loader tokenizes and packs the whole global batch on every rank to keep G/D of it; the prepared
loader reads only its G/D windows from the memory map (the store is in the page cache here: a
cold parallel file system adds its read latency).
Reported per rank: milliseconds per global batch and the tokens/s that rank's loader delivers,
next to what one H100 consumes training Llama 3 8B (torchtitan's 5,762 tokens/s/GPU) and a 1B
model at 40% MFU.
"""

import argparse
import logging
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.bench.timing import median_seconds  # noqa: E402
from trillion.devices import lookup_device
from trillion.models import get_preset
from trillion.models.flops import model_flops_per_token
from trillion.trainer.config.schema import Data, load_config
from trillion.trainer.data.loader import build_data_loader, build_documents
from trillion.trainer.data.prepare import prepare
from trillion.trainer.data.tokenizer import build_tokenizer

TORCHTITAN_LLAMA3_8B_H100 = 5762  # tokens/s/GPU, torchtitan's benchmark (local batch 2 x 8192, FSDP)


def train_bpe(path: Path, documents: int, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer trained on the first `documents` documents of the default corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = build_documents(Data(), 0).iterate(0, documents)
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer.save(str(path))
    return path


def tokenizer_args(kind: str, bpe: Path) -> list[str]:
    return ["--tokenizer.kind=hf", f"--tokenizer.path={bpe}"] if kind == "bpe" else []


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the workers)."""
    return sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )


def measure_prepare(root: Path, kind: str, bpe: Path, workers: int, data: list[str]) -> dict:
    out = root / f"{kind}-{workers}.tokens"
    cpu = cpu_seconds()
    manifest = prepare(load_config(None, [*data, *tokenizer_args(kind, bpe)]), out, workers)
    return {
        "tokenizer": kind,
        "workers": workers,
        "tokens": manifest["n_tokens"],
        "seconds": manifest["seconds"],
        "tokens_per_s": manifest["n_tokens"] / manifest["seconds"],
        "cpu_s": cpu_seconds() - cpu,
        "store": out,
    }


def measure_loader(
    kind: str,
    store: Path,
    tokenizer,
    dp: int,
    rank: int,
    seq_len: int,
    global_batch: int,
    repeats: int,
    data: list[str],
) -> float:
    """Median seconds per global batch of rank `rank` of `dp` data-parallel ranks, after a warm-up batch."""
    data_config = load_config(None, [f"--data.prepared={store}"] if kind == "prepared" else data).data
    loader = build_data_loader(
        data_config,
        tokenizer,
        seed=0,
        seq_len=seq_len,
        global_batch_size=global_batch,
        micro_batch_size=global_batch // dp,
        held_out=0.01,
        dp_rank=rank,
        dp_size=dp,
    )
    return median_seconds(loader.next_batch, torch.device("cpu"), warmup=1, repeats=repeats)


def h100_needs(seq_len: int) -> str:
    peak = lookup_device("h100").peak_tflops_bf16 * 1e12
    one_b = 0.4 * peak / model_flops_per_token(get_preset("llama3-1b"), seq_len)
    return (
        f"one H100 consumes {TORCHTITAN_LLAMA3_8B_H100:,} tokens/s training Llama 3 8B (torchtitan, measured) and "
        f"{one_b:,.0f} tokens/s training Llama 3 1B at 40% MFU (sequence {seq_len}, {peak / 1e12:.0f} TFLOP/s bf16)"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny subset of the corpus, for the tests")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64, help="sequences per global batch (a multiple of 64)")
    parser.add_argument("--repeats", type=int, default=50, help="timed global batches of the prepared loader")
    parser.add_argument(
        "--on-the-fly-repeats", type=int, default=3, help="timed global batches of the on-the-fly loader"
    )
    parser.add_argument("--bpe-vocab", type=int, default=16384)
    parser.add_argument("--bpe-documents", type=int, default=300, help="default-corpus documents to train the BPE on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        data = []
        if args.smoke:  # a dozen documents of the default corpus as a jsonl file
            import json

            corpus = root / "subset.jsonl"
            corpus.write_text(
                "".join(json.dumps({"text": t}) + "\n" for t in build_documents(Data(), 0).iterate(0, 12))
            )
            data = [f"--data.path={corpus}"]
            args.seq_len, args.global_batch, args.bpe_vocab, args.bpe_documents = 64, 64, 400, 12
            args.repeats, args.on_the_fly_repeats = 3, 2
        bpe = train_bpe(root / "bpe.json", args.bpe_documents, args.bpe_vocab)
        prepared = [measure_prepare(root, kind, bpe, workers, data) for kind in ("byte", "bpe") for workers in (1, 2)]
        print(
            f"\n## prepare-data (load average of this machine's {os.cpu_count()} CPUs: "
            f"{os.getloadavg()[0]:.1f} after it)\n"
        )
        print(
            "| tokenizer | workers | tokens | seconds | CPU seconds (all processes) | tokens/s "
            "| tokens per CPU second |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in prepared:
            print(
                f"| {row['tokenizer']} | {row['workers']} | {row['tokens']:,} | {row['seconds']:.1f} | "
                f"{row['cpu_s']:.1f} | {row['tokens_per_s']:,.0f} | {row['tokens'] / row['cpu_s']:,.0f} |"
            )
        print(
            f"\n## loader, one rank, BPE (vocabulary {args.bpe_vocab}), global batch {args.global_batch} x "
            f"{args.seq_len} tokens\n"
        )
        print("| loader | dp | ms per global batch (rank 0 / rank dp-1) | tokens/s delivered to the rank |")
        print("|---|---|---|---|")
        tokenizer = build_tokenizer(load_config(None, tokenizer_args("bpe", bpe)).tokenizer)
        store = next(row["store"] for row in prepared if row["tokenizer"] == "bpe")
        per_rank = {}
        for kind in ("prepared", "on-the-fly"):
            repeats = args.repeats if kind == "prepared" else args.on_the_fly_repeats
            for dp in (1, 8, 64):
                seconds = [
                    measure_loader(kind, store, tokenizer, dp, rank, args.seq_len, args.global_batch, repeats, data)
                    for rank in sorted({0, dp - 1})
                ]
                per_rank[kind, dp] = args.global_batch // dp * args.seq_len / max(seconds)
                print(
                    f"| {kind} | {dp} | {' / '.join(f'{1e3 * s:.2f}' for s in seconds)} | {per_rank[kind, dp]:,.0f} |"
                )
        print(
            f"\nFor scale: {h100_needs(args.seq_len)}. At dp 64 one rank's prepared loader delivers "
            f"{per_rank['prepared', 64] / TORCHTITAN_LLAMA3_8B_H100:,.0f}x the Llama 3 8B figure, the on-the-fly "
            f"one {per_rank['on-the-fly', 64] / TORCHTITAN_LLAMA3_8B_H100:.2f}x."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
