"""Where documents come from: local files or a Hugging Face dataset (HFDocuments), or the embedded
default corpus, this Python's standard-library sources (FileDocuments). A source is read by index
(`iterate(start, stop, step)`), so lanes and a resumed position read it from anywhere."""

import contextlib
import itertools
import random
import sysconfig
from pathlib import Path

from trillion.errors import ConfigError, RunAborted
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.data.diagnosis import bad_file_problem

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


def build_documents(cfg: DataConfig, seed: int):
    if cfg.path or cfg.name:
        return HFDocuments(cfg)
    return FileDocuments(default_corpus_files(seed))
