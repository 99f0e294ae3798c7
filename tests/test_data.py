"""Dataset files and rows: errors name the file, the line or row, and the column."""

import pytest

from grpokit.data import DataError, DatasetOptions, check_columns, load_jsonl


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


def test_load_csv_and_its_errors(tmp_path):
    from grpokit.resolve import load_rows

    good = tmp_path / "d.csv"
    good.write_text('prompt,answer,topic\n"What is 1, 2?",3,sums\nQ2,4,\n')
    assert load_rows(good) == [{"prompt": "What is 1, 2?", "answer": "3", "topic": "sums"},
                               {"prompt": "Q2", "answer": "4", "topic": ""}]
    extra = tmp_path / "extra.csv"
    extra.write_text("prompt,answer\na,1\nb,2,oops\n")
    with pytest.raises(DataError, match=r"extra.csv: line 3 has more cells than the header's 2 columns"):
        load_rows(extra)
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,answer\ncaf\xe9,1\n")
    with pytest.raises(DataError, match=r"latin.csv: not valid UTF-8"):
        load_rows(latin)
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,answer\n")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(empty)


def test_parquet_and_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    from grpokit.resolve import load_eval_rows, load_rows

    rows = [{"prompt": "What is 1 + 1?", "answer": "2", "level": 1}, {"prompt": "Q2", "answer": "4", "level": 2}]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "train.parquet"))
    assert load_rows(tmp_path / "train.parquet") == rows
    table.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(tmp_path / "saved") == rows
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "splits"))
    assert load_rows(tmp_path / "splits") == rows  # the train split
    test_split = DatasetOptions(split="test", split_key="dataset_test_split")  # eval_dataset's
    assert load_eval_rows(tmp_path / "splits", test_split) == rows
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match=r"no_train: a DatasetDict without a 'train' split \(its splits: \['test'\]\); "
                                        "set dataset_train_split"):
        load_rows(tmp_path / "no_train")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"junk.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "junk.parquet")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"empty_dir: not a directory written by save_to_disk"):
        load_rows(tmp_path / "empty_dir")


def test_without_datasets_a_hub_id_or_folder_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    from grpokit.resolve import load_rows

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DataError, match=r"dataset 'owner/name' \(config None, split 'train'\) needs the `datasets` "
                                        r"package: pip install 'grpokit\[data\]'"):
        load_rows("owner/name")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"needs the `datasets` package: pip install 'grpokit\[data\]'"):
        load_rows(tmp_path / "folder")
