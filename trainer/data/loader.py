"""Documents -> tokens -> packed windows of seq_len + 1 -> this rank's micro-batches.

Layout independence (DESIGN.md): global batch i is windows [i*G, (i+1)*G) of one token stream,
whatever the parallel layout; data-parallel rank r of D takes the r-th contiguous slice of G/D
windows. Every rank packs the whole stream, which keeps that guarantee simple and exact; the
price is tokenizing D times, which is small next to a training step.

Document lanes (data.lanes = L): the global window stream interleaves L lanes. Lane j packs
documents j, j+L, j+2L, ... of the seeded document order into its own stream (epoch after epoch),
and window k of the run comes from lane k mod L, so a batch of G windows draws from min(G, L)
documents and a document's windows are spread over many steps instead of filling consecutive
ones (a model trained on one file after another drifts toward the file it is on). L = 1 is one
document after another.

The loader's position is, per lane, (epoch, document index, token offset within that document),
and the lane the next window comes from: a few integers that mean the same thing under any layout,
so a resumed run sees exactly the batches it would have seen.

Held-out split: a document is held out for evaluation when a hash of its text falls in the
`eval.held_out` share (`is_held_out`). That depends on nothing but the text, so the same documents
are withheld whatever the seed, the order or the number of ranks, and training skips exactly them.
"""

import codecs
import contextlib
import hashlib
import itertools
import json
import logging
import os
import random
import sysconfig
from pathlib import Path

import numpy as np
import torch

from trillion.errors import ConfigError, RunAborted
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.config.schema import Eval as EvalConfig
from trillion.trainer.data.prepared import build_prepared_loader

log = logging.getLogger("trillion")
SUFFIX_TO_BUILDER = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


def default_corpus_files(seed: int) -> list[Path]:
    """The Python standard library's own sources: real text on every machine, no download.

    Sorted, then shuffled with the run's seed, so the order is fixed for a given seed and
    consecutive windows do not all come from one package.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    random.Random(seed).shuffle(files)
    return files


class FileDocuments:
    """Each file is one document."""

    source = "The default corpus"

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def count(self) -> int | None:
        return len(self.files)

    def iterate(self, start: int, stop: int | None = None, step: int = 1):
        for path in self.files[start:stop:step]:
            yield path.read_text(encoding="utf-8", errors="replace")


class HFDocuments:
    """Documents from a Hugging Face `datasets` dataset (local files or a hub name). A file that cannot
    be read is named with its cause (bad_file_problem); the library's own error lines are kept quiet."""

    def __init__(self, cfg: DataConfig):
        import datasets

        datasets.disable_progress_bars()
        self.source = f"data.path={cfg.path!r}" if cfg.path else f"data.name={cfg.name!r}"
        self.text_field, self.files, self.builder = cfg.text_field, [], ""
        try:
            with _quiet(datasets):
                if cfg.path:
                    self.builder, files = _local_files(cfg.path)
                    self.files = [f for f in files if f.stat().st_size > 0]  # an empty file holds no document
                    if not self.files:
                        raise ConfigError(_empty_message(cfg.path, files))
                    kwargs = {"sample_by": "paragraph"} if self.builder == "text" else {}
                    self.dataset = datasets.load_dataset(
                        self.builder,
                        data_files=[str(f) for f in self.files],
                        split=cfg.split,
                        streaming=cfg.streaming,
                        **kwargs,
                    )
                else:
                    self.dataset = datasets.load_dataset(
                        cfg.name, cfg.config_name or None, split=cfg.split, streaming=cfg.streaming
                    )
        except ConfigError:
            raise
        except ConnectionError as error:  # the hub, unreachable: not a mistake in the settings
            raise RunAborted(
                f"{self.source} could not be fetched: {_root_cause(error)}. The Hugging Face hub is not reachable "
                "from here (or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set): run where it is, or download the "
                "dataset and point data.path at its files."
            ) from None
        except Exception as error:  # a file the library cannot read: its traceback would not say which, or why
            if not cfg.path and not isinstance(
                error, (datasets.exceptions.DatasetGenerationError, FileNotFoundError, ValueError)
            ):
                raise
            raise ConfigError(self._read_failure(error)) from None
        columns = self.dataset.column_names
        if columns is not None and cfg.text_field not in columns:
            raise ConfigError(
                f"data.text_field={cfg.text_field!r} is not a column of {self.source} (its columns: "
                f"{', '.join(columns)}). Set --data.text_field to the column holding the text."
            )
        feature = (self.dataset.features or {}).get(cfg.text_field)
        if isinstance(feature, datasets.Value) and feature.dtype not in ("string", "large_string", "null"):
            raise ConfigError(self._not_text(f"holds {feature.dtype} values"))

    def _read_failure(self, error: Exception) -> str:
        """The message for a dataset the library failed to read: the bad file and its cause when one is found."""
        if self.files and (problem := bad_file_problem(self.builder, self.files)):
            return f"{self.source}: {problem}"
        cause = _root_cause(error)
        if "split" in cause.lower():
            advice = "Check that data.split exists."
        elif not self.files:
            advice = "Check data.name, data.config_name and data.split."
        elif len(self.files) > 1:
            advice = "Check that its files share one format and one set of columns."
        else:
            advice = "Check the file's contents."
        kind = f" as {self.builder} data" if self.builder else " as a dataset"
        return f"{self.source} could not be read{kind} ({cause}). {advice}"

    def _not_text(self, what: str, fix: str = "Set --data.text_field to the column holding the document text.") -> str:
        return f"{self.source}: data.text_field={self.text_field!r} {what}, not text. {fix}"

    def __len__(self) -> int:
        return len(self.dataset)  # not for a streamed dataset

    def count(self) -> int | None:
        """The number of documents, None for a streamed dataset."""
        import datasets

        return None if isinstance(self.dataset, datasets.IterableDataset) else len(self.dataset)

    def iterate(self, start: int, stop: int | None = None, step: int = 1):  # stop: not for a streamed dataset
        import datasets

        streamed = isinstance(self.dataset, datasets.IterableDataset)
        if streamed:  # a stream read by L lanes is read L times
            rows = itertools.islice(self.dataset.skip(start), 0, None, step)
        else:
            rows = self.dataset.select(range(start, len(self.dataset) if stop is None else stop, step))
        try:
            for index, row in zip(itertools.count(start, step), rows):
                text = row[self.text_field]
                if text is None:
                    text = ""
                elif not isinstance(text, str):
                    raise ConfigError(
                        self._not_text(
                            f"of row {index} (counting from 0) holds {text!r:.40} ({type(text).__name__})",
                            "Every document's text must be a string (or null for none): fix that record.",
                        )
                    )
                yield text
        except ConfigError:
            raise
        except Exception as error:  # a streamed file is read only now
            if not streamed:
                raise
            raise ConfigError(self._read_failure(error)) from None


@contextlib.contextmanager
def _quiet(datasets):
    """The library logs a failing file's error before raising it; the ConfigError says it once, in full."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost exception's message (the library wraps the real cause)."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        error = inner
        seen.add(id(error))
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _empty_message(path: str, files: list[Path]) -> str:
    what = f"{files[0]} is empty" if len(files) == 1 else f"all {len(files)} of its data files are empty (0 bytes)"
    return f"data.path={path!r} holds no text: {what}. Point it at a file or folder holding the documents."


def bad_file_problem(builder: str, files: list[Path]) -> str | None:
    """What is wrong with the first unreadable file among `files` (read as `builder` data), or None:
    bytes that are not UTF-8 (byte offset and line), a JSON line that does not parse or is not a record
    (file:line), a Parquet file that is not one, or files with nothing but blank lines. Reads the files
    through: called only once the library has failed, to say why."""
    for file in files:
        try:
            problem = _parquet_problem(file) if builder == "parquet" else _utf8_problem(file)
            if not problem and builder == "json":
                problem = _json_problem(file)
        except OSError as error:
            problem = f"{file} cannot be read ({error.strerror or error}). Check its permissions."
        if problem:
            return problem
    if builder == "json" and not any(_has_text(f) for f in files):
        what = f"{files[0]} holds" if len(files) == 1 else f"its {len(files)} data files hold"
        return f"{what} no records, only blank lines. Point data.path at a file or folder holding the documents."
    return None


def _utf8_problem(file: Path) -> str | None:
    """The first byte of `file` that is not UTF-8, as its offset, line and value."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(file, "rb") as f:
        while True:
            block = f.read(1 << 20)
            carried = len(decoder.getstate()[0])  # the start of a character split across blocks
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                at = offset - carried + error.start
                byte = error.object[error.start]
                return (
                    f"{file} is not UTF-8 text: byte offset {at} (line {_line_of(file, at)}) is 0x{byte:02X}, "
                    f"which UTF-8 does not allow there ({error.reason}). Data files are read in the UTF-8 encoding: "
                    "convert this one, e.g. `iconv -f latin1 -t utf-8` for Latin-1 text."
                )
            if not block:
                return None
            offset += len(block)


def _line_of(file: Path, offset: int) -> int:
    lines = 1
    with open(file, "rb") as f:
        while offset > 0 and (block := f.read(min(offset, 1 << 20))):
            lines, offset = lines + block.count(b"\n"), offset - len(block)
    return lines


def _has_text(file: Path) -> bool:
    with open(file, "rb") as f:
        return any(block.strip() for block in iter(lambda: f.read(1 << 20), b""))


JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "true/false"}


def _json_kind(value) -> str:
    return "null" if value is None else JSON_KINDS.get(type(value), type(value).__name__)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _json_problem(file: Path) -> str | None:
    """A JSON Lines file needs one record (a JSON object) per non-blank line; a .json file may instead be one
    JSON document (an array of records, or an object of columns), which the reader accepts too."""
    problem = None
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"), parse_constant=_reject_constant)
            except ValueError as error:
                reason = f"{error.msg}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else error
                problem = (
                    f"{file}:{number} is not valid JSON ({reason}). Each line of a JSON Lines file is one record: "
                    "fix or remove that line."
                )
                break
            if not isinstance(value, dict):
                problem = (
                    f"{file}:{number} is a JSON {_json_kind(value)}, where each line must be one record: a JSON "
                    "object holding the document's text. Fix or remove that line."
                )
                break
    if problem is None:
        return None
    text = file.read_text(encoding="utf-8")
    try:
        whole = json.loads(text, parse_constant=_reject_constant)
    except ValueError as error:
        if not text.lstrip().startswith("[") or not isinstance(error, json.JSONDecodeError):
            return problem  # JSON Lines: the first bad line
        return (
            f"{file}:{error.lineno} is not valid JSON ({error.msg}, column {error.colno}): the file is read as one "
            "JSON array of records. Fix it there."
        )
    if isinstance(whole, list):
        bad = next((i for i, item in enumerate(whole) if not isinstance(item, dict)), None)
        return (
            None
            if bad is None
            else f"{file}: item {bad} of its JSON array is a {_json_kind(whole[bad])}, where each item must be one "
            "record: a JSON object holding the document's text. Fix or remove that item."
        )
    if isinstance(whole, dict):
        return None  # columns: the reader's own error says what it refused
    return (
        f"{file} holds one JSON {_json_kind(whole)}, not records. Give JSON Lines (one JSON object per line) or "
        "a JSON array of objects, each holding a document's text."
    )


def _parquet_problem(file: Path) -> str | None:
    import pyarrow.parquet

    try:
        pyarrow.parquet.read_metadata(file)
    except Exception as error:  # pyarrow's errors are ArrowInvalid, OSError, ...
        text = str(error).strip()
        return (
            f"{file} is not a readable Parquet file ({text.splitlines()[0] if text else type(error).__name__}). "
            "Write it again as Parquet, or move it out of data.path."
        )
    return None


def _local_files(path: str) -> tuple[str, list[Path]]:
    root = Path(path)
    if not root.exists():
        raise ConfigError(
            f"data.path={path!r}: no such file or folder. Point it at a json, jsonl, txt or parquet file, "
            "or a folder of them (or leave it empty for the embedded default corpus)."
        )
    if root.is_file() and root.suffix not in SUFFIX_TO_BUILDER:
        raise ConfigError(
            f"data.path={path!r} is not a data file this reader knows (by its name: {root.suffix or 'no suffix'}). "
            f"Use a file ending in {', '.join(SUFFIX_TO_BUILDER)}."
        )
    files = (
        sorted(p for p in root.rglob("*") if p.suffix in SUFFIX_TO_BUILDER and p.is_file()) if root.is_dir() else [root]
    )
    if not files:
        raise ConfigError(
            f"data.path={path!r} is a folder with no data file in it (none ends in {', '.join(SUFFIX_TO_BUILDER)}). "
            "Point it at the folder holding the documents, or at one file."
        )
    builders = {SUFFIX_TO_BUILDER[f.suffix] for f in files}
    if len(builders) > 1:
        raise ConfigError(f"data.path={path!r} mixes file kinds ({', '.join(sorted(builders))}); point it at one kind.")
    return builders.pop(), files


def held_out_fraction(cfg: EvalConfig) -> float:
    """The share of training documents held out: none when evaluation reads a separate set."""
    return 0.0 if cfg.path or cfg.name else cfg.held_out


def is_held_out(text: str, fraction: float) -> bool:
    """Whether this document (its text exactly as the loader reads it) belongs to the held-out split:
    the first 8 bytes of its BLAKE2b digest, read as a fraction of 2**64, fall below `fraction`.
    A pure function of the text, so identical documents always land on the same side."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2.0**64


def build_documents(cfg: DataConfig, seed: int):
    if cfg.path or cfg.name:
        return HFDocuments(cfg)
    return FileDocuments(default_corpus_files(seed))


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
        if self._stream is None:
            self._stream, self._pending = self._chunks(), []
        need = count * self.window
        have = sum(len(chunk[3]) for chunk in self._pending)
        while have < need:
            self._pending.append(next(self._stream))
            have += len(self._pending[-1][3])
        flat = []
        while len(flat) < need:
            epoch, index, start, tokens = self._pending.pop(0)
            use = min(len(tokens), need - len(flat))
            flat.extend(tokens[:use])
            if use < len(tokens):
                self._pending.insert(0, (epoch, index, start + use, tokens[use:]))
                self.epoch, self.doc_index, self.offset = epoch, index, start + use
            else:
                self.epoch, self.doc_index, self.offset = epoch, index + self.lanes, 0
        return torch.tensor(flat, dtype=torch.long).view(count, self.window)

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
        lanes = len(self.lanes)
        order = (self.next_lane + torch.arange(count)) % lanes
        out = torch.empty(count, self.window, dtype=torch.long)
        for lane in range(lanes):
            rows = torch.nonzero(order == lane).flatten()
            if len(rows):
                out[rows] = self.lanes[lane].next_windows(len(rows))
        self.next_lane = (self.next_lane + count) % lanes
        return out

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
    documents, dealt = iter(token_documents), 0
    pending = [[] for _ in range(lanes)]  # per lane: token arrays not yet in a window
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
                pending[dealt % lanes].append(np.asarray(tokens, dtype=np.int64))
                held[dealt % lanes] += len(tokens)
                dealt += 1
        if held[lane] < window:  # its documents are used up
            turn.pop(place)
            continue
        flat = np.concatenate(pending[lane])
        out.append(flat[:window])
        pending[lane], held[lane] = [flat[window:]], held[lane] - window
        place += 1
    if not out:
        return torch.empty(0, window, dtype=torch.long)
    return torch.from_numpy(np.stack(out))


class DataLoader:
    """Yields, per optimizer step, this data-parallel rank's micro-batches as (inputs, labels)."""

    def __init__(
        self, windows: LanedWindows, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ):
        self.windows = windows
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.local = global_batch_size // dp_size
        self.dp_rank = dp_rank

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.windows.next_windows(self.global_batch_size)
        mine = batch[self.dp_rank * self.local : (self.dp_rank + 1) * self.local]
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.micro_batch_size)]

    def state_dict(self) -> dict:
        return self.windows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.windows.load_state_dict(state)


def build_data_loader(
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
) -> DataLoader:
    """The training stream; `held_out` (held_out_fraction of the eval section) is the share it skips."""
    if cfg.prepared:
        return build_prepared_loader(
            cfg,
            tokenizer,
            seed=seed,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            held_out=held_out,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    documents = build_documents(cfg, seed)
    windows = LanedWindows(
        documents,
        tokenizer,
        seq_len + 1,
        keep=lambda text: not is_held_out(text, held_out),
        lanes=lane_count(documents, cfg.lanes),
        setting=cfg.lanes,
    )
    return DataLoader(windows, global_batch_size, micro_batch_size, dp_rank, dp_size)
