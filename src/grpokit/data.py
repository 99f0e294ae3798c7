"""Prompt datasets: a list of dict rows, loaded from JSONL, CSV, Parquet, ``datasets``' directories or the Hugging Face
Hub and checked before any training starts; what the model and the reward functions see of a row (the rendered prompt,
the reward keywords).

Errors name the file (or the Hub id, its config and split), the line (1-based) and the column at fault.
"""

from __future__ import annotations

import csv
import difflib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and column."""


class FileRow(dict):
    """A row of a JSONL or CSV file that knows the file line it starts on (1-based; a CSV file's header is line 1), so
    that errors name the line an editor shows rather than the row's index among the rows (:func:`row_place`)."""

    __slots__ = ("line",)

    def __init__(self, values: Mapping[str, Any], line: int) -> None:
        super().__init__(values)
        self.line = line


def row_place(row: Mapping[str, Any], index: int) -> str:
    """How an error names a row: ``"line N"`` for a row of a JSONL or CSV file (:class:`FileRow`), else
    ``"row INDEX"`` (0-based: rows from the Hub, a Parquet file, a dataset folder or Python)."""
    line = getattr(row, "line", None)
    return f"line {line}" if line is not None else f"row {index}"


def refuse_unknown(given: Iterable[str], known: Sequence[str], what: str, kind: str, kinds: str) -> None:
    """A DataError naming the first of ``given`` that ``known`` lacks (``"{what}: unknown {kind} 'x'"``), the closest
    known name and all of them (``"({kinds}: ...)"``); nothing when every one is known."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(f"{what}: unknown {kind} {unknown[0]!r}{hint} ({kinds}: {', '.join(known)})")


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (one JSON object per line, each a :class:`FileRow`; blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {str(path)!r} does not exist")
    rows = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}: line {line_number} is not valid UTF-8 ({error.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: line {line_number} is not valid JSON: {error.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {line_number} is a JSON {type(row).__name__}, expected an object")
            rows.append(FileRow(row, line_number))
    if not rows:
        raise DataError(f"dataset file {str(path)!r} has no rows")
    return rows


def load_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header line (UTF-8); every value is text, each row a :class:`FileRow`. Errors name
    the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {str(path)!r} does not exist")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            rows = []
            for row in reader:
                if None in row:  # more cells than header columns
                    raise DataError(f"{path}: line {reader.line_num} has more cells than the header's "
                                    f"{len(reader.fieldnames or [])} columns")
                # reader.line_num is the record's last line; a quoted value's line breaks put its first above
                rows.append(FileRow(row, reader.line_num - sum(value.count("\n") for value in row.values())))
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    except csv.Error as error:
        raise DataError(f"{path}: line {reader.line_num}: {error}") from None
    if not rows:
        raise DataError(f"dataset file {str(path)!r} has no rows")
    return rows


def load_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file (needs pyarrow: ``pip install 'grpokit[data]'``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'grpokit[data]'") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    if not rows:
        raise DataError(f"dataset file {str(path)!r} has no rows")
    return rows


def _datasets(what: str) -> Any:
    """The ``datasets`` package, or a DataError saying that ``what`` needs it (it is an optional extra)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what} needs the `datasets` package: pip install 'grpokit[data]'") from None
    return datasets


@dataclass(frozen=True)
class DatasetOptions:
    """How a config's dataset keys read a source: the ``config`` and ``split`` of one that has them (a Hub id, a
    dataset folder, a ``save_to_disk`` DatasetDict; a single file has neither) and the ``columns`` renamed
    (:func:`rename_columns`). ``split_key``: the config key that chose ``split``, named in errors."""

    config: str | None = None
    split: str = "train"
    columns: Mapping[str, str] | None = None
    split_key: str = "dataset_train_split"


def load_saved_dataset(path: str | Path, split: str = "train",
                       split_key: str = "dataset_train_split") -> list[dict[str, Any]]:
    """Rows of a directory written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict's
    ``split``); needs ``pip install 'grpokit[data]'``."""
    datasets = _datasets(f"{path}: reading a saved `datasets` directory")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{path}: not a directory written by save_to_disk ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: a DatasetDict without a {split!r} split (its splits: {sorted(loaded)}); set "
                            f"{split_key}")
        loaded = loaded[split]
    rows = loaded.to_list()
    if not rows:
        raise DataError(f"{path}: the dataset has no rows")
    return rows


def is_saved_dataset(path: str | Path) -> bool:
    """Whether a directory is one ``save_to_disk`` wrote (the files ``load_from_disk`` reads), not a dataset folder."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or all((path / name).is_file()
                                                         for name in ("state.json", "dataset_info.json"))


def load_dataset_rows(path: str, options: DatasetOptions | None = None) -> list[dict[str, Any]]:
    """Rows of one split of what ``datasets.load_dataset`` reads: a Hugging Face Hub id (from the Hub, or from
    datasets' cache when offline) or a local dataset folder (data files, and a README.md whose ``configs:`` header
    names the configs, as on the Hub). Errors name the dataset, its config and split, and the key that fixes them."""
    options = options or DatasetOptions()
    where = f"{path!r} (config {options.config!r}, split {options.split!r})"
    datasets = _datasets(f"dataset {where}")
    elsewhere = "" if Path(path).exists() else "; no local file or folder has that name either"
    try:
        loaded = datasets.load_dataset(path, options.config, split=options.split)
    except ConnectionError:  # not cached, and the Hub is off (HF_HUB_OFFLINE) or out of reach
        offline = "is off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)" if datasets.config.HF_HUB_OFFLINE \
            else "cannot be reached"
        raise DataError(
            f"dataset {where} is not in datasets' cache ({datasets.config.HF_DATASETS_CACHE}) and the Hugging Face Hub "
            f"{offline}{elsewhere}. Load it once where the Hub is reachable (any grpokit command that names it does), "
            "then copy that cache here, or point HF_HOME (or HF_DATASETS_CACHE) at a cache that holds it") from None
    except (ValueError, OSError, getattr(datasets.exceptions, "DatasetsError", OSError)) as error:
        text = " ".join(str(error).split()).rstrip(".")  # datasets' messages span lines
        hints = [key for word, key in (("config", "dataset_config"), ("split", options.split_key))
                 if word in text.lower()]
        fix = f"; set {' or '.join(hints)}" if hints else ""
        if "cache" in text.lower():  # offline, the cache holds other configs or splits of it
            fix += ", or load this one once where the Hugging Face Hub is reachable"
        if isinstance(error, FileNotFoundError):
            fix += elsewhere
        raise DataError(f"dataset {where}: {text}{fix}") from None
    rows = loaded.to_list()
    if not rows:
        raise DataError(f"dataset {where} has no rows")
    return rows


def load_file(path: str | Path, options: DatasetOptions | None = None) -> list[dict[str, Any]]:
    """Rows of a file by its kind: a ``save_to_disk`` directory, another directory through ``datasets.load_dataset``
    (a dataset folder: ``options`` choose its config and split), ``.csv``, ``.parquet``, else JSON lines (names
    such as ``builtin:``, ``gsm8k:`` and Hub ids are :func:`grpokit.resolve.load_rows`'s)."""
    options = options or DatasetOptions()
    if Path(path).is_dir():
        if is_saved_dataset(path):
            return load_saved_dataset(path, options.split, options.split_key)
        if not any(p.is_file() for p in Path(path).rglob("*")):
            raise DataError(f"{path}: not a directory written by save_to_disk, nor a dataset folder (it holds no file)")
        return load_dataset_rows(str(path), options)
    if str(path).lower().endswith(".csv"):
        return load_csv(path)
    if str(path).lower().endswith(".parquet"):
        return load_parquet(path)
    return load_jsonl(path)


def rename_columns(rows: list[dict[str, Any]], columns: Mapping[str, str] | None,
                   source: str) -> list[dict[str, Any]]:
    """``rows`` with their columns renamed, ``{old: new}`` (``dataset_columns``); a column to rename that no row has,
    or a new name that another column keeps, is an error naming both."""
    if not columns:
        return rows
    present = list(dict.fromkeys(key for row in rows for key in row))
    missing = [old for old in columns if old not in present]
    if missing:
        raise DataError(f"{source}: dataset_columns renames {missing} but no row has such a column (the rows' "
                        f"columns: {present})")
    kept = [key for key in present if key not in columns]
    taken = [new for new in columns.values() if new in kept]
    if taken or len(set(columns.values())) < len(columns):
        raise DataError(f"{source}: dataset_columns {dict(columns)} gives two columns one name "
                        f"({taken or list(columns.values())}); rename or drop the other one too")
    renamed = [{columns.get(key, key): value for key, value in row.items()} for row in rows]
    return [FileRow(new, row.line) if isinstance(row, FileRow) else new for new, row in zip(renamed, rows)]


def given_rows(rows: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The rows passed in Python as ``name`` (``train_dataset=``, ``eval_dataset=``): a sequence of dicts or a
    ``datasets.Dataset``; a DatasetDict (a dict of splits) is refused, naming its splits."""
    if isinstance(rows, Mapping):
        raise DataError(f"{name}: a mapping ({sorted(map(str, rows))}), not rows; pass a list of dicts or one split "
                        f"of a DatasetDict, e.g. {name}=dataset['train']")
    rows = rows.to_list() if hasattr(rows, "to_list") and hasattr(rows, "column_names") else list(rows)
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{name}: row {index} is a {type(row).__name__}, expected a dict of columns")
    return rows


def check_columns(
    rows: Sequence[dict[str, Any]], required: Sequence[str], *, source: str = "dataset", prompt: bool = True
) -> None:
    """Every row has every required column (a near miss is suggested), the prompt column (the first; ``prompt``
    False: none) holds non-empty text, and an ``id`` column, if any, has no duplicates. Errors name a file's row by
    its line (:func:`row_place`)."""
    if not rows:
        raise DataError(f"{source} has no rows")
    seen_ids: dict[Any, str] = {}
    for index, row in enumerate(rows):
        place = row_place(row, index)
        for column in required:
            if column not in row:
                close = difflib.get_close_matches(column, [str(k) for k in row], n=1)
                hint = f"; did you mean {close[0]!r}? (set the config's column name)" if close else ""
                raise DataError(
                    f"{source}: {place} has no column {column!r} (its columns: {sorted(row)}){hint}"
                )
            if row[column] is None:
                raise DataError(f"{source}: {place} column {column!r} is null")
        if "id" in row:  # an id column, when there is one, must identify rows
            key = json.dumps(row["id"], sort_keys=True)
            if key in seen_ids:
                raise DataError(f"{source}: {seen_ids[key]} and {place} share id {row['id']!r}")
            seen_ids[key] = place
        if not prompt or not required:
            continue
        prompt_value = row[required[0]]
        if isinstance(prompt_value, list):  # chat messages
            if not prompt_value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in prompt_value):
                raise DataError(f"{source}: {place} column {required[0]!r} must be text or a non-empty list "
                                "of {\"role\": ..., \"content\": ...} messages")
        elif not isinstance(prompt_value, str) or not prompt_value:
            raise DataError(f"{source}: {place} column {required[0]!r} must be a non-empty string (or a list "
                            "of chat messages)")


def check_prompt_lengths(prompts: Sequence[str], tokenizer: Any, max_completion_length: int,
                         context: int | None) -> None:
    """Every prompt leaves room for ``max_completion_length`` new tokens in the model's ``context``."""
    if context is None:
        return
    room = context - max_completion_length
    # A prompt longer in characters than `room` tokens of the widest token could hold is too long
    # without tokenizing it (a 10 MB line would take seconds).
    widest = max(map(len, tokenizer.get_vocab()), default=1)
    for index, prompt in enumerate(prompts):
        if len(prompt) > room * widest:
            raise DataError(
                f"row {index}: prompt of {len(prompt)} characters (at least {len(prompt) // widest} tokens) + "
                f"max_completion_length {max_completion_length} exceeds the model's context of {context} tokens"
            )
    for index, ids in enumerate(tokenizer(list(prompts))["input_ids"]):
        if len(ids) > room:
            raise DataError(
                f"row {index}: prompt of {len(ids)} tokens + max_completion_length {max_completion_length} "
                f"exceeds the model's context of {context} tokens"
            )


def gsm8k_rows(rows: Sequence[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """GSM8K-style rows from any source (``question``; ``answer`` = worked solution ending ``#### 72``) as
    ``{"prompt": question, "answer": "72", "solution": worked solution}``; errors name ``source`` and the row."""
    converted = []
    for index, row in enumerate(rows):
        for column in ("question", "answer"):
            if not isinstance(row.get(column), str):
                raise DataError(f"{source}: row {index} needs a text column {column!r} (GSM8K format)")
        solution, marker, final = row["answer"].rpartition("####")
        if not marker or not final.strip():
            raise DataError(f"{source}: row {index} answer has no '#### <final answer>' line (GSM8K format)")
        converted.append({"prompt": row["question"], "answer": final.strip().replace(",", ""),
                          "solution": solution.strip()})
    return converted


def load_gsm8k(path: str | Path) -> list[dict[str, Any]]:
    """The GSM8K-style rows (:func:`gsm8k_rows`) of a JSONL file."""
    return gsm8k_rows(load_jsonl(path), str(path))


# ---- what the model and the reward functions see of a row ---------------------------------------


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *, system_prompt: str | None = None,
                  chat_template: bool | None = None, tools: Sequence[Callable] | None = None) -> str:
    """The text a prompt is sampled from: a plain prompt as is (after ``system_prompt`` on its own line), or
    rendered with the tokenizer's chat template and its generation prompt — always for a list of
    ``{role, content}`` messages, for plain text when ``chat_template`` is True or None and the
    tokenizer has one. ``tools``: listed by the chat template (JSON schemas from their type hints and
    Google-style docstrings, in transformers), for a template that knows tools
    (:mod:`grpokit.rollout.tool_templates`)."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) or (chat_template is not False and has_template):
        if not has_template:
            raise ValueError("a prompt is a list of chat messages but the tokenizer has no chat template")
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=True)
    if chat_template:
        raise ValueError("chat_template is true but the tokenizer has no chat template")
    return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"


def reward_column_names(rows: Sequence[dict[str, Any]], prompt_column: str, answer_column: str) -> dict[str, str]:
    """Keyword → dataset column, for what reward functions receive besides the reward arguments: every
    column but the prompt under its own name, and the answer column also as ``answer`` (taking the name
    over from any column called ``answer``)."""
    names = {key: key for key in dict.fromkeys(key for row in rows for key in row) if key != prompt_column}
    return {**names, "answer": answer_column}


def reward_columns(rows: Sequence[dict[str, Any]], prompt_column: str, answer_column: str,
                   repeat: int = 1) -> dict[str, list]:
    """What reward functions receive of the rows besides the reward arguments (:func:`reward_column_names`): each
    keyword's values, each row's repeated ``repeat`` times (once per completion of its group)."""
    names = reward_column_names(rows, prompt_column, answer_column)
    return {name: [row.get(key) for row in rows for _ in range(repeat)] for name, key in names.items()}
