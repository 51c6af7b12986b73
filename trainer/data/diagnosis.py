"""Why a data file cannot be read, said precisely: the first byte that is not UTF-8, the JSON line
that does not parse or is not a record, a Parquet file that is not one. Asked only once the reader
has failed, so the cost of reading the files through is paid only on the way to an error."""

import codecs
import json
from pathlib import Path


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
