"""Dataset files and rows: errors name the file, the line or row, and the column."""

import pytest

from grpokit.data import DataError, check_columns, load_jsonl


def test_load_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2}\n')
    assert load_jsonl(path) == [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "has no rows"),
        (b'{"prompt": "a"}\n{"prompt": \n', r"line 2 is not valid JSON"),
        (b'{"prompt": "a"}\n[1, 2]\n', r"line 2 is a JSON list, expected an object"),
        (b'{"prompt": "\xff"}\n', r"line 1 is not valid UTF-8"),
    ],
)
def test_bad_files(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_jsonl(path)


def test_missing_file():
    with pytest.raises(DataError, match="'nope.jsonl' does not exist"):
        load_jsonl("nope.jsonl")


def test_missing_column_names_row_and_column():
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "solution": 2}]
    match = r"data.jsonl: row 1 has no column 'answer' \(its columns: \['prompt', 'solution'\]\)"
    with pytest.raises(DataError, match=match):
        check_columns(rows, ["prompt", "answer"], source="data.jsonl")


@pytest.mark.parametrize("row, match", [({"prompt": "", "answer": 1}, "non-empty string"),
                                        ({"prompt": 3, "answer": 1}, "non-empty string"),
                                        ({"prompt": "a", "answer": None}, "column 'answer' is null")])
def test_bad_values(row, match):
    with pytest.raises(DataError, match=match):
        check_columns([row], ["prompt", "answer"])
