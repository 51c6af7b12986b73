"""Training from token stores (`data.prepared=DIR[:weight],...`): each rank reads only its windows.

Window k of a store is tokens[k*W:(k+1)*W] with W = seq_len + 1 (the tail shorter than a window is
left out). Global sample g (counted from the start of the run) is assigned to a source by the
blend, and becomes that source's n-th sample; sample n of a source with K windows lies in epoch
n // K at position n % K of the epoch's permutation of its windows. Global batch i is samples
[i*G, (i+1)*G) and data-parallel rank r of D reads samples [i*G + r*G/D, i*G + (r+1)*G/D) only,
whatever the layout. The position is the samples consumed, in all and per source: a few integers,
the same on every rank and under every layout, so a checkpoint resumes exactly and under any layout.

Blending is deterministic: each sample goes to the source furthest below its weight's share of the
samples so far (largest w_s (g + 1) - n_s, the first on ties), so after g samples every source
has w_s g of them within one sample (Megatron's blended dataset does the same).

Shuffling needs no table: the permutation of an epoch is a Feistel network on the smallest even
number of bits that holds K windows, seeded by (job.seed, source, epoch) and cycle-walked back into
range, so it is computed per index in O(1) memory however large the store.
"""

import logging
from pathlib import Path

import numpy as np
import torch

from trillion.errors import ConfigError
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.data.documents import window_micro_batches
from trillion.trainer.data.token_store import CHUNKS, HELD_OUT, TokenStore
from trillion.trainer.data.windows import dealt_windows_with_documents

log = logging.getLogger("trillion")
FEISTEL_ROUNDS = 6


class WindowPermutation:
    """A seeded bijection of range(n), evaluated per index."""

    def __init__(self, n: int, seed: tuple[int, ...]):
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + bits % 2) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence(list(seed)).generate_state(FEISTEL_ROUNDS, dtype=np.uint64)

    def __call__(self, index: np.ndarray) -> np.ndarray:
        out = self._encrypt(np.asarray(index, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():  # a permutation of [0, 2^bits) walks back into [0, n) within its cycle
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            mixed = (right ^ key) * np.uint64(0x9E3779B97F4A7C15)  # splitmix64's finalizer, wrapping mod 2^64
            mixed ^= mixed >> np.uint64(29)
            mixed *= np.uint64(0xBF58476D1CE4E5B9)
            mixed ^= mixed >> np.uint64(32)
            left, right = right, left ^ (mixed & self.mask)
        return (left << half) | right


def parse_prepared(spec: str) -> list[tuple[str, float]]:
    """`DIR[:weight],...` -> [(DIR, weight)]; weights default to 1 and are normalized later."""
    sources = []
    for item in (part.strip() for part in spec.split(",")):
        path, _, weight_text = item.rpartition(":")
        try:
            weight = float(weight_text) if path else 1.0
        except ValueError:  # a colon inside the path, no weight
            path, weight = item, 1.0
        path = path or item
        if not path or not weight > 0 or weight == float("inf"):
            raise ConfigError(
                f"data.prepared={spec!r}: {item!r} is not DIR or DIR:weight with a positive weight. "
                "Write e.g. --data.prepared=/data/web.tokens:0.7,/data/code.tokens:0.3."
            )
        sources.append((path, weight))
    return sources


class PreparedLoader:
    """Yields, per optimizer step, this data-parallel rank's micro-batches as (inputs, labels), with their
    document ids (from the stores' document offsets) or positions under data.document_mask or
    data.reset_positions."""

    def __init__(
        self,
        stores: list[TokenStore],
        weights: list[float],
        window: int,
        seed: int,
        shuffle: bool,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        mask: bool = False,
        reset: bool = False,
    ):
        self.stores, self.window, self.seed, self.shuffle = stores, window, seed, shuffle
        self.mask, self.reset = mask, reset
        self.weights = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.n_windows = [store.n_tokens // window for store in stores]
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.local = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.position, self.consumed = 0, np.zeros(len(stores), dtype=np.int64)

    def _assign(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and per-source sample numbers of the next `count` global samples; advances the position."""
        if len(self.stores) == 1:
            numbers = self.position + np.arange(count)
            self.position, self.consumed[0] = self.position + count, self.position + count
            return np.zeros(count, np.int64), numbers
        sources, numbers = np.empty(count, np.int64), np.empty(count, np.int64)
        for i in range(count):
            s = int(np.argmax(self.weights * (self.position + i + 1) - self.consumed))
            sources[i], numbers[i] = s, self.consumed[s]
            self.consumed[s] += 1
        self.position += count
        return sources, numbers

    def _windows(self, source: int, numbers: np.ndarray) -> np.ndarray:
        """Window indices in the store of the source's samples `numbers`."""
        per_epoch = self.n_windows[source]
        epochs, places = np.divmod(numbers, per_epoch)
        if not self.shuffle:
            return places
        out = np.empty_like(places)
        for epoch in np.unique(epochs):
            permutation = WindowPermutation(per_epoch, (self.seed, source, int(epoch)))
            out[epochs == epoch] = permutation(places[epochs == epoch])
        return out

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sources, numbers = self._assign(self.global_batch_size)
        mine = slice(self.dp_rank * self.local, (self.dp_rank + 1) * self.local)
        sources, numbers = sources[mine], numbers[mine]
        documents = self.mask or self.reset
        batch = np.empty((self.local, self.window), dtype=np.int64)
        ids = np.empty_like(batch) if documents else None
        for source in np.unique(sources):
            rows = np.flatnonzero(sources == source)
            for row, k in zip(rows, self._windows(int(source), numbers[rows])):
                span = int(k) * self.window, (int(k) + 1) * self.window
                batch[row] = self.stores[source].tokens(*span)
                if documents:
                    ids[row] = self.stores[source].document_ids(*span)
        ids = torch.from_numpy(ids) if documents else None
        return window_micro_batches(
            torch.from_numpy(batch), ids, self.micro_batch_size, mask=self.mask, reset=self.reset
        )

    def shares(self) -> list[float]:
        """Each source's share of the samples so far."""
        return (self.consumed / max(self.position, 1)).tolist()

    def _identity(self) -> list[str]:
        return [store.manifest["files"][CHUNKS]["sha256"] for store in self.stores]

    def state_dict(self) -> dict:
        """The position; called at every checkpoint, which is when the shares so far are logged."""
        log.info(
            "data: %d samples so far, shares %s",
            self.position,
            ", ".join(f"{s.path.name} {100 * share:.2f}%" for s, share in zip(self.stores, self.shares())),
        )
        return {
            "kind": "prepared",
            "position": self.position,
            "consumed": self.consumed.tolist(),
            "sources": self._identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "prepared":
            raise ConfigError(
                "The checkpoint being resumed was trained on data read on the fly (data.path / "
                "data.name), but this run sets data.prepared. Resume with the run's own data settings, "
                "or start a new --job.output_dir."
            )
        if state["sources"] != self._identity():
            raise ConfigError(
                f"The checkpoint being resumed was trained on other token stores than data.prepared="
                f"{','.join(str(s.path) for s in self.stores)} (their contents differ). Resume with the "
                "run's own data.prepared, or start a new --job.output_dir."
            )
        self.position, self.consumed = state["position"], np.asarray(state["consumed"], dtype=np.int64)


def build_prepared_loader(
    cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    held_out: float,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> PreparedLoader:
    """The training loader over the stores; `held_out` (the run's held-out share) must be the one
    each store was prepared with, so the documents evaluation reads were never trained on."""
    if cfg.path or cfg.name:
        raise ConfigError(
            f"data.prepared={cfg.prepared!r} and data.{'path' if cfg.path else 'name'} are both set; a run "
            "trains from one or the other. Drop data.path / data.name (the store records its source)."
        )
    sources = parse_prepared(cfg.prepared)
    stores = [TokenStore(path, sample_seed=dp_rank) for path, _ in sources]  # ranks check different chunks
    window = seq_len + 1
    for store in stores:
        store.check_tokenizer(tokenizer)
        if held_out and store.manifest["held_out"] != held_out:
            raise ConfigError(
                f"data.prepared: {str(store.path)!r} was prepared holding out eval.held_out="
                f"{store.manifest['held_out']:g} of its documents for evaluation, but this run holds out "
                f"{held_out:g}. Run with --eval.held_out={store.manifest['held_out']:g}, or prepare the data "
                f"again with --eval.held_out={held_out:g}."
            )
        if store.n_tokens < window:
            raise ConfigError(
                f"data.prepared: {str(store.path)!r} holds {store.n_tokens} tokens, fewer than one window "
                f"of training.seq_len + 1 = {window}. Use a larger store or a shorter training.seq_len."
            )
    loader = PreparedLoader(
        stores,
        [w for _, w in sources],
        window,
        seed,
        cfg.shuffle,
        global_batch_size,
        micro_batch_size,
        dp_rank,
        dp_size,
        mask=cfg.document_mask,
        reset=cfg.reset_positions,
    )
    for store, weight, windows in zip(stores, loader.weights, loader.n_windows):
        log.info(
            "data: %s, weight %.1f%% of the samples (%d tokens, %d windows of %d: an epoch every %.0f steps), %s",
            store.path,
            100 * weight,
            store.n_tokens,
            windows,
            window,
            windows / (weight * global_batch_size),
            "shuffled" if cfg.shuffle else "in file order",
        )
    return loader


def read_held_out_windows(cfg: DataConfig, tokenizer, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `count` windows of seq_len + 1 tokens of the stores' held-out documents (each store's
    DIR/held_out/, in the order data.prepared names them), dealt over data.lanes lanes as the
    on-the-fly evaluation set is (`windows.dealt_windows`), and their document ids: the evaluation set.
    Fewer (none) when they hold fewer: the evaluation decides what that means."""
    stores = [TokenStore(Path(path) / HELD_OUT) for path, _ in parse_prepared(cfg.prepared)]
    for store in stores:
        store.check_tokenizer(tokenizer)

    def documents():
        for store in stores:
            offsets = store.documents()
            for start, stop in zip(offsets[:-1], offsets[1:]):
                yield store.tokens(int(start), int(stop))

    return dealt_windows_with_documents(documents(), cfg.lanes, seq_len + 1, count)
