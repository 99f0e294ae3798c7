"""Hugging Face datasets by id (docs/own_task.md, "A Hugging Face dataset"): how a name is recognised, a dataset folder
with configs and splits, datasets' cache read offline, the errors of an id that is not cached, of a config or a split
that does not exist, renamed columns, the GSM8K preset on Hub rows, rows passed in Python as a ``datasets.Dataset``,
and the routes from Python and the command line to a run. Nothing here reaches the network: every test runs with
HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, against folders and a cache built in its tmp_path."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.cli.main import main
from grpokit.config import ConfigError, SFTConfig
from grpokit.data import DataError, DatasetOptions, given_rows
from grpokit.resolve import dataset_options, is_hub_id, load_eval_rows, load_model_and_tokenizer, load_rows
from helpers import CHAT_TEMPLATE, write_config

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")

# GSM8K's shape, small enough for the tiny model's 64 positions: configs 'main' (train, test) and 'socratic' (train).
QUESTIONS = {("main", "train"): ["What is 70 + 2?", "Half of 20?", "What is 4,000 + 1,000?"],
             ("main", "test"): ["What is 3 + 4?", "What is 9 - 1?"],
             ("socratic", "train"): ["Why is 2 + 2 four?"]}
ANSWERS = {"What is 70 + 2?": "70 + 2 = 72\n#### 72", "Half of 20?": "20 / 2 = 10\n#### 10",
           "What is 4,000 + 1,000?": "#### 5,000", "What is 3 + 4?": "#### 7", "What is 9 - 1?": "#### 8",
           "Why is 2 + 2 four?": "Count.\n#### 4"}
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-00000-of-00001.parquet
  - split: test
    path: main/test-00000-of-00001.parquet
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-00000-of-00001.parquet
---
# somename: a GSM8K-shaped dataset repository, as on the Hub
"""


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and datasets' cache (HF_DATASETS_CACHE) in tmp_path: the environment variables for what reads them
    later, and the values datasets and huggingface_hub read them into when imported (before this test)."""
    home = tmp_path / "hf_home"
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home),
                        "HF_DATASETS_CACHE": str(home / "datasets"), "HF_HUB_CACHE": str(home / "hub")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.chdir(tmp_path)  # a relative name is looked for here first
    return home


@pytest.fixture
def repo_folder(tmp_path):
    """A local dataset repository named `somename`: Parquet files and a README.md whose `configs:` header names them."""
    folder = tmp_path / "somename"
    for (config, split), questions in QUESTIONS.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        table = datasets.Dataset.from_list([{"question": q, "answer": ANSWERS[q]} for q in questions])
        table.to_parquet(str(folder / config / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text(CARD)
    return folder


@pytest.fixture
def cached(repo_folder, offline):
    """`someowner/somename` in datasets' cache, as a download on a machine with the Hub leaves it
    (HF_DATASETS_CACHE/someowner___somename/main/0.0.0/HASH/: dataset_info.json, somename-train.arrow, ...): the
    repository folder's 'main' config prepared by datasets itself, moved to the Hub id's place. The folder moves to
    ./gsm8k (a local copy under another name, as `hf download --local-dir gsm8k` leaves one): nothing is named
    somename any more but the cache's entry."""
    datasets.load_dataset(str(repo_folder), "main")
    cache = offline / "datasets"
    (cache / "somename").rename(cache / "someowner___somename")
    repo_folder.rename(repo_folder.parent / "gsm8k")
    return "someowner/somename"


GSM8K = GRPOConfig(dataset_config="main")  # the keys' defaults, with GSM8K's config


@pytest.mark.parametrize("name, hub", [
    ("openai/gsm8k", True), ("gsm8k", True), ("trl-lib/ultrafeedback-prompt", True), ("owner/data.v2", True),
    ("hf:data/train.jsonl", True),  # hf: forces the Hub
    ("data/train.jsonl", False), ("missing.jsonl", False), ("train.parquet", False), ("./somename", False),
    ("a/b/c", False), ("/abs/path", False), ("somename", False),  # a local folder of that name exists
])
def test_what_names_a_hub_dataset(repo_folder, name, hub):
    assert is_hub_id(name) == hub


def test_a_dataset_folder_reads_its_configs_and_splits(repo_folder):
    assert load_rows("somename", options=dataset_options(GSM8K))[0] == {"question": "What is 70 + 2?",
                                                                       "answer": "70 + 2 = 72\n#### 72"}
    held = load_eval_rows(str(repo_folder), dataset_options(GSM8K, held_out=True))  # the test split
    assert [row["question"] for row in held] == QUESTIONS["main", "test"]
    socratic = load_rows("somename", options=dataset_options(GRPOConfig(dataset_config="socratic")))
    assert [row["question"] for row in socratic] == QUESTIONS["socratic", "train"]


@pytest.mark.parametrize("keys, match", [
    ({}, r"dataset 'somename' \(config None, split 'train'\): Config name is missing.*\['main', 'socratic'\].*; set "
         "dataset_config"),
    ({"dataset_config": "mian"}, r"config 'mian'.*not found. Available: \['main', 'socratic'\]; set dataset_config"),
    ({"dataset_config": "main", "dataset_train_split": "validation"},
     r"split 'validation'\): Unknown split \"validation\". Should be one of \['train', 'test'\]; set "
     "dataset_train_split"),
])
def test_a_missing_config_or_split_is_named_with_what_exists(repo_folder, keys, match):
    with pytest.raises(DataError, match=match):
        load_rows("somename", options=dataset_options(GRPOConfig(**keys)))


def test_a_cached_hub_dataset_loads_offline(cached):
    rows = load_rows(cached, options=dataset_options(GSM8K))
    assert [row["question"] for row in rows] == QUESTIONS["main", "train"]
    assert load_rows(f"hf:{cached}", options=dataset_options(GSM8K)) == rows
    held = load_eval_rows(cached, dataset_options(GSM8K, held_out=True))
    assert [row["question"] for row in held] == QUESTIONS["main", "test"]
    # a local folder of the same name: the name is the folder's, `hf:` still the Hub's (here its cache)
    Path(cached).mkdir(parents=True)
    Path(cached, "train.jsonl").write_text(json.dumps({"question": "local?", "answer": "#### 1"}) + "\n")
    assert load_rows(cached) == [{"question": "local?", "answer": "#### 1"}]
    assert load_rows(f"hf:{cached}", options=dataset_options(GSM8K)) == rows


def test_a_hub_dataset_that_is_not_cached_says_how_to_get_it(cached, offline):
    with pytest.raises(DataError) as error:
        load_rows("someowner/missing", options=DatasetOptions("main", "test", split_key="dataset_test_split"))
    message = str(error.value)
    assert message.startswith("dataset 'someowner/missing' (config 'main', split 'test') is not in datasets' cache")
    for said in (str(offline / "datasets"), "the Hugging Face Hub is off (HF_HUB_OFFLINE", "no local file or folder",
                 "where the Hub is reachable", "point HF_HOME (or HF_DATASETS_CACHE) at a cache that holds it"):
        assert said in message
    # cached, but not that config: the cache's configs are listed
    with pytest.raises(DataError, match=r"config 'socratic'.*Available configs in the cache: \['main'\]; set "
                                        "dataset_config, or load this one once where the Hugging Face Hub is "
                                        "reachable"):
        load_rows(cached, options=DatasetOptions("socratic"))


def test_a_missing_file_is_still_a_missing_file():
    with pytest.raises(DataError, match="dataset file 'data/train.jsonl' does not exist"):
        load_rows("data/train.jsonl")


def test_the_gsm8k_preset_splits_the_answer_off_hub_rows(cached, repo_folder):
    rows = load_rows(f"gsm8k:{cached}", options=dataset_options(GSM8K))
    assert [row["answer"] for row in rows] == ["72", "10", "5000"]  # thousands separators dropped, as from JSONL
    assert rows[0] == {"prompt": "What is 70 + 2?", "answer": "72", "solution": "70 + 2 = 72"}
    (repo_folder.parent / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"gsm8k:train.jsonl: row 0 answer has no '#### <final answer>' line"):
        load_rows("gsm8k:train.jsonl")


def test_dataset_columns_rename_a_files_columns_too(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "Q?", "reference": "1", "topic": "t"}) + "\n")
    renamed = load_rows(path, options=dataset_options(GRPOConfig(dataset_columns={"question": "prompt",
                                                                                  "reference": "answer"})))
    assert renamed == [{"prompt": "Q?", "answer": "1", "topic": "t"}]
    with pytest.raises(DataError, match=r"qa.jsonl: dataset_columns renames \['query'\] but no row has such a column "
                                        r"\(the rows' columns: \['question', 'reference', 'topic'\]\)"):
        load_rows(path, options=DatasetOptions(columns={"query": "prompt"}))
    with pytest.raises(DataError, match=r"gives two columns one name \(\['topic'\]\)"):
        load_rows(path, options=DatasetOptions(columns={"question": "topic"}))
    with pytest.raises(ConfigError, match="dataset_columns must be a mapping"):
        GRPOConfig(dataset_columns=["question"])


def test_rows_passed_in_python_may_be_a_datasets_dataset():
    rows = [{"prompt": "a", "answer": "1"}]
    assert given_rows(datasets.Dataset.from_list(rows), "train_dataset") == rows
    split = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    with pytest.raises(DataError, match=r"eval_dataset: a mapping \(\['train'\]\), not rows; .*eval_dataset=dataset"):
        given_rows(split, "eval_dataset")
    with pytest.raises(DataError, match="train_dataset: row 0 is a str, expected a dict of columns"):
        given_rows(["a prompt"], "train_dataset")


def run_config(tmp_path, **keys):
    values = dict(output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=2, max_completion_length=4,
                  max_steps=1, progress_bar=False, mixed_precision="no", reward_funcs=["math_accuracy"])
    return GRPOConfig(**{**values, **keys})


def test_grpo_trains_on_a_cached_hub_dataset_and_evaluates_eval_dataset_rows(cached, tokenizer, tiny_model, tmp_path):
    """Python: the GSM8K preset on the cached Hub id trains; eval_dataset= (a datasets.Dataset) is the held-out set,
    instead of the config's eval_dataset, through the checks the config's rows go through."""
    config = run_config(tmp_path, dataset=f"gsm8k:{cached}", dataset_config="main", eval_dataset="builtin:arithmetic",
                        eval_samples=0)
    held = datasets.Dataset.from_list([{"prompt": "What is 1 + 1?", "answer": "2"}])
    trainer = GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, eval_dataset=held)
    assert [row["answer"] for row in trainer.sampler.rows] == ["72", "10", "5000"]
    assert trainer.held_out.rows == held.to_list()
    history = trainer.train()
    assert history[0]["eval_prompts"] == 1 and history[-1]["step"] == 1
    with pytest.raises(DataError, match=r"eval_dataset: row 0 has no column 'answer'"):
        GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, eval_dataset=[{"prompt": "q"}])
    with pytest.raises(ConfigError, match="eval_fraction and eval_dataset= both choose the held-out rows"):
        GRPOTrainer(run_config(tmp_path, eval_fraction=0.5), model=tiny_model, tokenizer=tokenizer,
                    train_dataset=held, eval_dataset=held)


def test_a_conversational_hub_style_dataset_trains(tmp_path, tokenizer, tiny_model):
    """TRL's conversational prompt-only format (prompt = [{role, content}, ...]) in a dataset folder, rendered with the
    chat template; its standard format (prompt = text) is the cached dataset's above."""
    folder = tmp_path / "chats"
    folder.mkdir()
    rows = [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a} + 1?"}],
             "answer": str(a + 1)} for a in range(4)]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer.chat_template = CHAT_TEMPLATE
    trainer = GRPOTrainer(run_config(tmp_path, dataset=str(folder), reward_funcs=["accuracy"]), model=tiny_model,
                          tokenizer=tokenizer)
    assert trainer.sampler.rows == rows and trainer.sampler.prompts[0] == "[system] Add.\n[user] 0 + 1?\n[assistant] "
    assert trainer.train()[-1]["step"] == 1


def test_sft_takes_datasets_and_a_dataset_folders_splits(repo_folder, tmp_path, tokenizer, tiny_model):
    from grpokit.algorithms.sft import SFTTrainer

    config = SFTConfig(model="unused", dataset="somename", dataset_config="main", eval_dataset="somename",
                       dataset_columns={"question": "prompt", "answer": "completion"}, output_dir=str(tmp_path / "sft"),
                       max_steps=1, batch_size=2, micro_batch_size=2, progress_bar=False, mixed_precision="no")
    trainer = SFTTrainer(config, model=tiny_model, tokenizer=tokenizer)
    assert trainer.summary["rows"] == 3 and trainer.summary["eval_rows"] == 2  # train and test splits
    rows = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 2)
    trainer = SFTTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=rows, eval_dataset=rows)
    assert trainer.summary["rows"] == 2 and trainer.summary["eval_rows"] == 2


def test_the_command_line_trains_on_a_hub_id_and_evaluates_its_test_split(cached, tmp_path, tiny_model_dir, capsys):
    config = write_config(tmp_path, tiny_model_dir, f"gsm8k:{cached}", dataset_config="main",
                          eval_dataset=f"gsm8k:{cached}", eval_samples=0, max_completion_length=4,
                          reward_funcs=["math_accuracy"])
    assert main(["train", str(config), "--max_steps", "1", "--num_generations", "2"]) == 0
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["eval_prompts"] == 2  # main's test split
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["dataset_config"] == "main"
    assert main(["train", str(config), "--dataset", "someowner/missing", "--max_steps", "1", "--output_dir",
                 str(tmp_path / "missing")]) == 2
    assert "error: dataset 'someowner/missing' (config 'main', split 'train') is not in datasets' cache" in \
        capsys.readouterr().err


def test_the_command_line_evaluates_a_dataset_folder_with_renamed_columns(repo_folder, tmp_path, tiny_model_dir):
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_model_dir), "--dataset", "somename", "--dataset_config", "main", "--dataset_columns",
                 "{question: prompt, answer: solution}", "--answer_column", "solution", "--num_generations", "0",
                 "--max_completion_length", "4", "--output", str(out), "--progress_bar", "false"]) == 0
    assert json.loads(out.read_text())["num_prompts"] == 2  # the test split


def test_the_command_line_samples_a_hub_ids_train_split(cached, tmp_path, tiny_model_dir):
    out = tmp_path / "sampled.jsonl"
    assert main(["sample", str(tiny_model_dir), "--dataset", f"gsm8k:{cached}", "--dataset_config", "main",
                 "--num_generations", "1", "--max_completion_length", "4", "--output", str(out), "--progress_bar",
                 "false"]) == 0
    prompts = {json.loads(line)["prompt"] for line in out.read_text().splitlines()}
    assert prompts == set(QUESTIONS["main", "train"])


def test_a_hub_model_id_loads_from_the_cache_offline(tiny_model_dir, offline):
    """`model: owner/name` is from_pretrained's: offline, a model in the Hub cache (HF_HOME/hub) loads."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline / "hub" / "models--someowner--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model, tokenizer = load_model_and_tokenizer("someowner/tiny", progress=False)
    assert model.config.num_hidden_layers == 2 and tokenizer("ab")["input_ids"]
    with pytest.raises(ValueError, match="model: cannot load 'someowner/other'"):
        load_model_and_tokenizer("someowner/other", progress=False)


def test_the_python_examples_of_own_task_md_run(cached, offline, tmp_path, tiny_model_dir):
    """docs/own_task.md's Python, run as written but on the tiny model, a few short steps and the test's cache:
    openai/gsm8k is `someowner/somename` there, owner/name a dataset with other column names."""
    folder = tmp_path / "name"
    folder.mkdir()
    for split in ("train", "test"):
        rows = [{"problem": f"What is {a} + 1?", "solution": str(a + 1)} for a in range(3)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets.load_dataset(str(folder))
    (offline / "datasets" / "name").rename(offline / "datasets" / "owner___name")
    shutil.rmtree(folder)
    page = (Path(__file__).parents[1] / "docs" / "own_task.md").read_text()
    section = page.split("\n## A Hugging Face dataset\n")[1].split("\n## ")[0]
    blocks = [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]
    assert len(blocks) == 4
    short = "max_steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4, eval_samples=0, " \
            "progress_bar=False, "
    namespace: dict = {}
    for code in blocks:  # in one namespace, as the page reads: a block may use an earlier one's imports
        for old, new in [('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tiny_model_dir))),
                         ('"path/to/model"', repr(str(tiny_model_dir))), ("openai/gsm8k", cached),
                         ("GRPOConfig(model=", f"GRPOConfig({short}model=")]:
            code = code.replace(old, new)
        assert short in code
        exec(compile(code, "docs/own_task.md", "exec"), namespace)
    for run in ("gsm8k", "mine", "folder", "offline"):  # steps 0 (the held-out rows evaluated, where given) and 1
        assert len((tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()) == (1 if run == "offline"
                                                                                               else 2)
