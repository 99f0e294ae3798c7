"""The first keys of a GRPO run (``GRPOConfig``): what it learns from — the model and the data, the held-out rows
and what judges them, the rewards."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.config.fields import _common, _DataKeys, _field
from grpokit.core.answers import ANSWER_EXTRACTIONS


@dataclass
class _TaskKeys(_DataKeys):
    """GRPOConfig's keys of the model, the data, held-out evaluation and the rewards."""

    # ---- model and data --------------------------------------------------------------------------
    model: str | None = _field(
        None,
        "Required (unless a model is passed in Python). A Hugging Face causal LM (AutoModelForCausalLM + "
        "AutoTokenizer, from_pretrained): a local directory or a Hub model id (offline: HF_HUB_OFFLINE=1 and the model "
        "in HF_HOME's cache); 'gguf:FILE' for a llama.cpp GGUF file, converted to float32 once and cached (pip "
        "install 'grpokit[gguf]'; or `grpokit convert` it); or 'builtin:arithmetic' for the warm-started tiny demo "
        "model (built and cached locally).",
    )
    dataset: str | None = _field(
        None,
        "Required (unless rows are passed in Python, or an environment gives them). A JSONL file (one JSON object "
        "per line), a CSV file with a header, a .parquet file, a directory written by datasets' save_to_disk, a "
        "dataset folder, or a Hugging Face Hub dataset id ('owner/name', or 'hf:ID'; dataset_config, "
        "dataset_train_split) — with a prompt column, an answer column, and any other columns, which reward functions "
        "receive as keyword lists; 'gsm8k:SOURCE' for GSM8K rows (question, answer ending '#### N') from any of them; "
        "'reasoning_gym:TASK' for a reasoning-gym task's generated rows (options: the reasoning_gym key; pip install "
        "'grpokit[reasoning_gym,sandbox]': its scorer runs in the sandbox); or 'builtin:arithmetic'.",
    )
    reasoning_gym: dict | None = _field(
        None, "Options of a 'reasoning_gym:TASK' dataset (or 'reasoning_gym:TASK1,TASK2', a mix): size (rows "
        "generated, 1000), seed (the run's), config (the task's settings; for a mix, task -> settings), weights (a "
        "mix's task -> weight, 1 each), eval_size (held-out rows, 200), eval_seed (seed + size: reasoning-gym draws "
        "row i from seed + i; questions the training rows hold are dropped).")
    answer_extraction: str = _field(
        "tag", "How the reasoning_gym reward reads a completion's answer before the task scores it: 'tag' (the text "
        "of its only <answer>...</answer>), 'boxed' (the last \\boxed{...}), 'last_line', 'last_number' or 'whole' "
        "(the whole completion).", choices=ANSWER_EXTRACTIONS)
    prompt_column: str = _field("prompt", "Dataset column holding the prompt text.")
    answer_column: str = _field(
        "answer", "Dataset column holding the reference answer (passed to rewards as `answer` and by its name).")
    output_dir: str = _field("runs/grpo", "Run directory: config, metrics.jsonl, completions.jsonl, model.",
                             resumable=True)
    seed: int = _field(0, "Seed for data order, sampling and initialisation.")
    device: str = _common("device")
    dtype: str = _common("dtype")
    system_prompt: str | None = _field(
        None, "A system message put before every prompt (e.g. asking for <think>…</think><answer>…</answer>, "
        "R1-Zero style): in the chat template when the tokenizer has one, else as a first line."
    )
    chat_template: bool | None = _field(
        None, "Render prompts with the tokenizer's chat template (with the generation prompt): None = when it "
        "has one. Rows whose prompt is a list of {role, content} messages always need one."
    )

    # ---- held-out evaluation during training (docs/metrics.md, "Held-out evaluation") ---------------
    eval_dataset: str | None = _field(
        None,
        "Held-out rows (the dataset's formats and columns; a Hub id: its dataset_test_split; a built-in task's name: "
        "its held-out set), evaluated before the first step, every eval_every steps and after the last, as `grpokit "
        "eval` evaluates; eval_dataset= in Python takes rows instead.",
    )
    eval_reward: str | None = _field(
        None, "What judges held-out completions (held-out evaluation, `grpokit eval`, the reward-gaming alarm): any "
        "reward_funcs entry giving one number per completion (a built-in name, 'reasoning_gym', 'FILE.py:NAME', "
        "'model:DIR'). A completion scoring 1 or more is solved (eval_accuracy: the rate); eval_score is the mean "
        "score (partial credit). With an environment, also one of its rubric's functions by name, or 'rubric' (the "
        "rubric's weighted total). None: the environment's rubric; 'accuracy' (with its lenient reading), "
        "'code_tests' for rows with a tests column, 'reasoning_gym' for a reasoning_gym: dataset.")
    eval_fraction: float = _field(
        0.0, "Instead of eval_dataset, this share of the dataset's rows held out (a seeded draw; never trained on).",
        min=0, lt=1)
    eval_every: int = _field(0, "Evaluate every this many steps (0: only before the first and after the last).",
                             min=0, resumable=True)
    eval_samples: int = _field(
        4, "Held-out evaluation: completions sampled per prompt (at the run's temperature) for the sampled accuracy "
        "and pass@1 / pass@eval_samples, beside the greedy accuracy; 0: greedy only.", min=0, resumable=True)
    eval_alarm_drop: float = _field(
        0.05, "The reward-gaming alarm: raised when held-out greedy accuracy has fallen at least this much (and "
        "beyond twice its standard error) below its best while the training reward rose above its level then.",
        gt=0, resumable=True)

    # ---- rewards ---------------------------------------------------------------------------------
    reward_funcs: list[str] | None = _field(
        None,
        "Reward functions: built-in names ('accuracy', 'math_accuracy' (math-verify when installed), 'format', "
        "'code_tests' (runs the program in each completion against the row's tests column, in the sandbox), "
        "'reasoning_gym' (the row's reasoning-gym task's own scorer, in the sandbox), the process rewards "
        "'arithmetic_steps', 'arithmetic_substeps'), 'FILE.py:NAME', 'package.module:NAME' (called as TRL calls "
        "them: docs/data_and_rewards.md), learned reward models as 'model:DIR' (an outcome model; a bare DIR too) or "
        "'process_model:DIR'; the Python API also takes callables. None: [accuracy, format], or [reasoning_gym] for "
        "a reasoning_gym: dataset.",
    )
    reward_weights: list[float] | None = _field(
        None, "Weight of each reward function in the total reward; None means 1.0 each.")

    # ---- agents (docs/agents.md) -------------------------------------------------------------------
    agent: str | None = _field(
        None, "'FILE.py:NAME' or 'package.module:NAME' of an agent that drives its own episodes: async def "
        "agent(client: openai.AsyncOpenAI, model: str, **row) -> float | dict[str, float] (a plain def gets an "
        "openai.OpenAI client). grpokit serves the policy over OpenAI's API, runs num_generations episodes per row "
        "against it, and trains the tokens the policy sampled with the reward the agent returned (no default reward "
        "is added; reward_funcs, if given, score each episode's transcript too). The Python API also takes the "
        "function.")
    agent_concurrency: int = _field(
        16, "Agent episodes running at once (the policy server batches their requests).", min=1, resumable=True)
    agent_timeout: float | None = _field(
        600.0, "Seconds one agent episode may take; a slower one stops the run, naming the agent, the row and the "
        "episode (null: no limit).", gt=0, resumable=True)
