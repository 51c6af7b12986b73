"""Documents -> tokens -> packed windows of seq_len + 1, in lanes.

Document lanes (data.lanes = L): the global window stream interleaves L lanes. Lane j packs
documents j, j+L, j+2L, ... of the seeded document order into its own stream (epoch after epoch),
and window k of the run comes from lane k mod L, so a batch of G windows draws from min(G, L)
documents and a document's windows are spread over many steps instead of filling consecutive
ones (a model trained on one file after another drifts toward the file it is on). L = 1 is one
document after another.

The position is, per lane, (epoch, document index, token offset within that document), and the
lane the next window comes from: a few integers that mean the same thing under any layout, so a
resumed run sees exactly the batches it would have seen. A finite set (evaluation) is dealt over
lanes the same way, once (dealt_windows).

The packer records where each document starts in every window: beside the tokens, each window's document
ids (non-decreasing along the window, a new id where a document starts), for document masking and the
position reset (trainer/data/documents.py).
"""

import itertools
import logging

import numpy as np
import torch

from trillion.errors import ConfigError

log = logging.getLogger("trillion")


class PackedWindows:
    """An endless stream of token windows of `window` tokens; documents joined with EOS. Only the
    documents `keep(text)` accepts enter it; the position still counts every document. As lane
    `lane` of `lanes` it reads documents lane, lane + lanes, lane + 2 lanes, ... only."""

    def __init__(self, documents, tokenizer, window: int, keep=lambda text: True, lane: int = 0, lanes: int = 1):
        self.documents, self.tokenizer, self.window, self.keep = documents, tokenizer, window, keep
        self.lane, self.lanes = lane, lanes
        self.epoch, self.doc_index, self.offset = 0, lane, 0
        self._stream, self._pending = None, []

    def _chunks(self):
        """Yield (epoch, doc_index, start_offset, tokens) from the saved position on, epoch after epoch."""
        epoch, first, offset = self.epoch, self.doc_index, self.offset
        while True:
            produced = False
            texts = self.documents.iterate(first, step=self.lanes)
            for index, text in zip(itertools.count(first, self.lanes), texts):
                if not self.keep(text):
                    continue
                tokens = self.tokenizer.encode(text)
                if tokens:
                    tokens.append(self.tokenizer.eos_id)
                    skip = offset if index == first else 0
                    produced = True
                    yield epoch, index, skip, tokens[skip:]
            if not produced and first == self.lane:
                if self.lanes > 1 and self._any_text():
                    raise ConfigError(
                        f"data.lanes={self.lanes}: lane {self.lane} (documents {self.lane}, "
                        f"{self.lane + self.lanes}, ... of the corpus order) holds no text: each of them "
                        "is empty or held out for evaluation. Lower --data.lanes (1 reads the documents "
                        "one after another)."
                    )
                source = getattr(self.documents, "source", "The dataset")
                raise ConfigError(
                    f"{source} holds no text: every document is empty (or held out for evaluation, see "
                    "eval.held_out). Check data.path or data.name and data.text_field."
                )
            epoch, first, offset = epoch + 1, self.lane, 0

    def _any_text(self) -> bool:
        """Whether any document of the whole corpus enters a stream (asked only to word an error)."""
        return any(self.keep(text) and self.tokenizer.encode(text) for text in self.documents.iterate(0))

    def next_windows(self, count: int) -> torch.Tensor:
        """The next `count` windows, shape (count, window); advances the position past them."""
        return self.next_windows_with_documents(count)[0]

    def next_windows_with_documents(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `count` windows and their document ids, both (count, window); advances the position."""
        if self._stream is None:
            self._stream, self._pending = self._chunks(), []
        need = count * self.window
        have = sum(len(chunk[3]) for chunk in self._pending)
        while have < need:
            self._pending.append(next(self._stream))
            have += len(self._pending[-1][3])
        flat, ids = [], []
        while len(flat) < need:
            epoch, index, start, tokens = self._pending.pop(0)
            use = min(len(tokens), need - len(flat))
            flat.extend(tokens[:use])
            ids.extend([ids[-1] + 1 if ids else 0] * use)  # one id per document piece, counting up
            if use < len(tokens):
                self._pending.insert(0, (epoch, index, start + use, tokens[use:]))
                self.epoch, self.doc_index, self.offset = epoch, index, start + use
            else:
                self.epoch, self.doc_index, self.offset = epoch, index + self.lanes, 0
        shape = (count, self.window)
        return torch.tensor(flat, dtype=torch.long).view(shape), torch.tensor(ids, dtype=torch.long).view(shape)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "doc_index": self.doc_index, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.doc_index, self.offset = state["epoch"], state["doc_index"], state["offset"]
        self._stream, self._pending = None, []


def lane_count(documents, lanes: int) -> int:
    """data.lanes, or the number of documents when there are fewer (a lane needs one)."""
    total = documents.count()
    if total is not None and total < lanes:
        log.info("data: %d documents, so %d lanes (data.lanes=%d)", total, max(total, 1), lanes)
        return max(total, 1)
    return lanes


class LanedWindows:
    """The run's window stream: window k comes from lane k mod L (module docstring). Its position is
    each lane's and the lane of the next window; with one lane it is that lane's, as saved before
    data.lanes existed."""

    def __init__(
        self, documents, tokenizer, window: int, keep=lambda text: True, lanes: int = 1, setting: int | None = None
    ):
        self.window, self.next_lane, self.setting = window, 0, setting or lanes  # setting: data.lanes
        self._lane = lambda lane, count: PackedWindows(documents, tokenizer, window, keep, lane, count)
        self.lanes = [self._lane(lane, lanes) for lane in range(lanes)]

    def next_windows(self, count: int) -> torch.Tensor:
        """The next `count` windows of the interleaved stream, shape (count, window)."""
        return self.next_windows_with_documents(count)[0]

    def next_windows_with_documents(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `count` windows of the interleaved stream and their document ids, both (count, window)."""
        lanes = len(self.lanes)
        order = (self.next_lane + torch.arange(count)) % lanes
        out, ids = (torch.empty(count, self.window, dtype=torch.long) for _ in range(2))
        for lane in range(lanes):
            rows = torch.nonzero(order == lane).flatten()
            if len(rows):
                out[rows], ids[rows] = self.lanes[lane].next_windows_with_documents(len(rows))
        self.next_lane = (self.next_lane + count) % lanes
        return out, ids

    def state_dict(self) -> dict:
        if len(self.lanes) == 1:
            return self.lanes[0].state_dict()
        states = [lane.state_dict() for lane in self.lanes]
        return {
            "lanes": len(self.lanes),
            "next_lane": self.next_lane,
            **{key: [state[key] for state in states] for key in ("epoch", "doc_index", "offset")},
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("lanes", 1)
        if saved > self.setting:
            raise ConfigError(
                f"The checkpoint being resumed read its documents in {saved} lanes but this run reads "
                f"at most {self.setting} (data.lanes). Resume with --data.lanes={saved}, or start a new "
                "--job.output_dir."
            )
        if saved != len(self.lanes):  # data.lanes is the same (resume_check): the number of documents changed
            log.warning(
                "data: the checkpoint read its documents in %d lanes; the changed corpus would give %d "
                "(data.lanes=%d, at most one per document): continuing in %d",
                saved,
                len(self.lanes),
                self.setting,
                saved,
            )
            self.lanes = [self._lane(lane, saved) for lane in range(saved)]
        if saved == 1:
            self.lanes[0].load_state_dict(state)
            self.next_lane = 0
            return
        for j, lane in enumerate(self.lanes):
            lane.load_state_dict({key: state[key][j] for key in ("epoch", "doc_index", "offset")})
        self.next_lane = state["next_lane"]


def token_documents(documents, tokenizer, keep=lambda text: True):
    """Each document `keep` accepts, as its tokens and EOS, in order (empty ones left out, as the loader does)."""
    for text in documents.iterate(0):
        if keep(text) and (tokens := tokenizer.encode(text)):
            yield tokens + [tokenizer.eos_id]


def dealt_windows(token_documents, lanes: int, window: int, count: int) -> torch.Tensor:
    """At most `count` windows of a finite set (an evaluation set): document m of `token_documents`
    (token sequences, EOS included) goes to lane m mod L, each lane packs its documents into windows,
    and the windows are taken from the lanes in turn; a lane whose documents are used up leaves the
    turn (its partial last window is dropped), and the set ends when every lane has. Never a window
    twice; with one lane, the first `count` windows of the documents joined."""
    return dealt_windows_with_documents(token_documents, lanes, window, count)[0]


def dealt_windows_with_documents(token_documents, lanes: int, window: int, count: int):
    """dealt_windows' windows and their document ids (document m's tokens have id m), both (windows, window)."""
    documents, dealt = iter(token_documents), 0
    pending = [[] for _ in range(lanes)]  # per lane: (tokens, ids) arrays not yet in a window
    held = [0] * lanes
    turn, out = list(range(lanes)), []
    place = 0
    while len(out) < count and turn:
        place %= len(turn)
        lane = turn[place]
        while held[lane] < window:
            tokens = next(documents, None)
            if tokens is None:
                break
            if len(tokens):
                pending[dealt % lanes].append((np.asarray(tokens, dtype=np.int64), np.full(len(tokens), dealt)))
                held[dealt % lanes] += len(tokens)
                dealt += 1
        if held[lane] < window:  # its documents are used up
            turn.pop(place)
            continue
        flat, ids = (np.concatenate(part) for part in zip(*pending[lane]))
        out.append((flat[:window], ids[:window]))
        pending[lane], held[lane] = [(flat[window:], ids[window:])], held[lane] - window
        place += 1
    if not out:
        return torch.empty(0, window, dtype=torch.long), torch.empty(0, window, dtype=torch.long)
    return tuple(torch.from_numpy(np.stack(part)) for part in zip(*out))
