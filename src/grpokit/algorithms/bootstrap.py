"""``grpokit bootstrap``: a cold start sampled from the model itself (docs/bootstrap.md) — DeepSeek-R1's cold-start
data (few-shot prompting, then filtering) and rejection sampling, and with ``iterations`` STaR's loop (expert
iteration): sample, keep what is right, fine-tune, sample again from the better model.

For each training prompt, K completions are sampled from the prompt after an instruction and optional few-shot
demonstrations, then scored by the run's own reward functions. Those the judge calls correct are kept, optionally
after being rewritten into the reply format the rewards expect: at most ``keep_per_prompt`` per prompt (which is what
keeps the set balanced: an easy prompt gives no more rows than a hard one that was solved that often), duplicates
removed. A kept row is an SFT row (``prompt`` as the dataset holds it, ``completion``) with its provenance.

Nothing sampled is lost on a crash: each batch's completions go to the samples log (``OUTPUT.samples-N.jsonl`` for
iteration N, :mod:`grpokit.algorithms.bootstrap_log`) as soon as they are generated, and their scores as soon as they
are scored; the same command run again goes on from the log (scoring what was sampled but not scored, then sampling
the rest). The output file and its summary are rebuilt from the logs at the end. :func:`bootstrap_from_config` is the
command: a config's rows, rewards and engine, and SFT between iterations.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.algorithms.bootstrap_log import BootstrapError, SamplesLog
from grpokit.core.answers import Text, extract_answer, last_number, text_of
from grpokit.data import check_columns, render_prompt, reward_column_names
from grpokit.rewards.calling import RewardFunction, check_reward_functions, reward_name, score_steps
from grpokit.rollout.engines import Engine
from grpokit.rollout.tools import ToolBox, with_observation

DEFAULT_INSTRUCTION = ("Think step by step inside <think> </think> tags, then write only the final answer inside "
                       "<answer> </answer> tags.")
REWRITES = ("none", "tags")
_TAGS_RE = re.compile(r"</?(?:think|answer)>")
_SHAPE_RE = re.compile(r"\s*<think>((?:(?!</?(?:think|answer)>).)*)</think>\s*<answer>((?:(?!</?(?:think|answer)>)"
                       r".)*)</answer>\s*", re.DOTALL)


@dataclass
class BootstrapSettings:
    """What one bootstrap pass samples and keeps (``grpokit bootstrap --help`` gives each flag)."""

    samples: int = 8  # K completions per prompt
    keep_per_prompt: int = 2
    judge: list[str] | None = None  # reward functions that must each score >= min_score; None: the first one
    min_score: float = 1.0
    instruction: str | None = DEFAULT_INSTRUCTION
    few_shot: list[dict[str, Any]] = field(default_factory=list)  # {prompt, completion} demonstrations
    rewrite: str = "none"  # "tags": the answer into <answer>, the rest into <think>
    batch_size: int = 16  # prompts per generation pass
    # self-consistency: a correct sample is kept only when at least this many of its prompt's samples of its round
    # give its answer (a lucky guess is seldom given twice)
    min_agreement: int = 1

    def __post_init__(self) -> None:
        if self.samples < 1 or self.keep_per_prompt < 1 or self.batch_size < 1:
            raise BootstrapError("samples, keep_per_prompt and batch_size must each be at least 1")
        if not 1 <= self.min_agreement <= self.samples:
            raise BootstrapError(f"min_agreement must be between 1 and the samples per prompt ({self.samples}), got "
                                 f"{self.min_agreement}")
        if self.rewrite not in REWRITES:
            raise BootstrapError(f"rewrite must be one of {REWRITES}, got {self.rewrite!r}")


def bootstrap_prompt(prompt: Text, instruction: str | None, few_shot: Sequence[dict[str, Any]], chat: bool) -> Text:
    """What the model is sampled from: the demonstrations, then the prompt, the instruction before each question.
    ``chat``: as chat messages (each demonstration a user and an assistant turn; a conversational prompt keeps its
    system message first and gets the instruction in its first user turn); else as one text, blocks apart.

    >>> bootstrap_prompt("2+2?", "Tag it.", [{"prompt": "1+1?", "completion": "<answer>2</answer>"}], chat=False)
    'Tag it.\\n\\n1+1?\\n<answer>2</answer>\\n\\n2+2?'
    """
    ask = (lambda q: q) if instruction is None else (lambda q: f"{instruction}\n\n{q}")
    if not chat:
        if isinstance(prompt, list):
            raise BootstrapError("a prompt is a list of chat messages but the tokenizer has no chat template")
        blocks = [instruction] if instruction is not None else []
        return "\n\n".join([*blocks, *(f"{text_of(d['prompt'])}\n{text_of(d['completion'])}" for d in few_shot),
                            prompt])
    demos = [turn for d in few_shot for turn in ({"role": "user", "content": ask(text_of(d["prompt"]))},
                                                 {"role": "assistant", "content": text_of(d["completion"])})]
    if isinstance(prompt, str):
        return [*demos, {"role": "user", "content": ask(prompt)}]
    system = [m for m in prompt if m["role"] == "system"]
    rest = [dict(m) for m in prompt if m["role"] != "system"]
    first_user = next((m for m in rest if m["role"] == "user"), None)
    if first_user is not None:
        first_user["content"] = ask(first_user["content"])
    return [*system, *demos, *rest]


def given_answer(completion: str) -> str | None:
    """The answer a completion gives, whitespace normalised (:func:`_answer_and_start`); None when it gives none.

    >>> given_answer("so <answer> 1 2 </answer>"), given_answer("it is 12."), given_answer("none")
    ('1 2', '12', None)
    """
    found = _answer_and_start(completion)
    return " ".join(found[0].split()) if found is not None else None


def _answer_and_start(completion: str) -> tuple[str, int] | None:
    """The answer a completion gives, stripped (its only ``<answer>``, else its last number), and where the text
    that gives it starts; None when it gives none."""
    tagged = extract_answer(completion)
    if tagged is not None and tagged.strip():
        return tagged.strip(), completion.index("<answer>")
    number = last_number(completion)
    return (number.group(), number.start()) if number is not None else None


def rewrite_to_tags(completion: str) -> str | None:
    """``<think>reasoning</think><answer>answer</answer>`` from a completion in another shape: the answer it gives
    (its only ``<answer>``, else its last number), the reasoning the text before it, stray tags removed. A completion
    already in that shape is returned as it is; None when it gives no answer.

    >>> rewrite_to_tags("7 plus 5 is 12.")
    '<think>7 plus 5 is</think><answer>12</answer>'
    >>> rewrite_to_tags("So: <answer>12</answer> done")
    '<think>So:</think><answer>12</answer>'
    """
    if _SHAPE_RE.fullmatch(completion):
        return completion
    found = _answer_and_start(completion)
    if found is None:
        return None
    answer, start = found
    reasoning = _TAGS_RE.sub("", completion[:start]).strip()
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


# ---- one pass --------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_and_score(
    engine: Engine, tokenizer: Any, rows: Sequence[dict[str, Any]], reward_funcs: Sequence[RewardFunction],
    reward_weights: Sequence[float], log: SamplesLog, settings: BootstrapSettings, *, prompt_column: str = "prompt",
    answer_column: str = "answer", max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
    system_prompt: str | None = None, chat_template: bool | None = None, seed: int = 0, prompting: bool = True,
    progress: bool = True, toolbox: ToolBox = ToolBox.NONE,
) -> None:
    """Sample K completions for every row the log has none for, and score every sampled row it has no scores for:
    the completions (and with ``rewrite``, their rewrites) by each reward function. ``prompting``: the instruction
    and demonstrations before each prompt (else the prompt as training renders it). ``toolbox``: the tools and
    environments the completions use, as in training; with environments, each batch is scored as it is sampled
    (the reward functions read the episodes' environments), and its prompts as the model saw them are logged."""
    chat = chat_template is not False and getattr(tokenizer, "chat_template", None) is not None
    k, size = settings.samples, settings.batch_size
    todo = [i for i in range(len(rows)) if i not in log.completions]
    bar = tqdm(total=len(rows), initial=len(rows) - len(todo), desc="bootstrap", unit="prompt", disable=not progress,
               dynamic_ncols=True)
    for start in range(0, len(todo), size):
        batch = todo[start:start + size]
        asked = [rows[i][prompt_column] for i in batch]
        if prompting:
            asked = [bootstrap_prompt(p, settings.instruction, settings.few_shot, chat) for p in asked]
        rendered = [render_prompt(tokenizer, p, system_prompt=system_prompt, chat_template=chat_template,
                                  tools=toolbox.prompt_tools()) for p in asked]
        # the environments reset with the rows as asked (an observation is appended to the prompt with instructions)
        tools = toolbox.session([{**rows[i], prompt_column: p} for i, p in zip(batch, asked)], k, max_new_tokens,
                                prompt_column)
        rendered, repeats = tools.sample_prompts(rendered, k)
        encoded = tokenizer(rendered, padding=True, padding_side="left", return_tensors="pt")
        # seeded by the batch's first row, so that a resumed run samples a row as the first run would have
        generator = torch.Generator(device=engine.device).manual_seed(seed * 1_000_003 + batch[0])
        rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=repeats,
                                  max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  generator=generator, tools=tools)
        texts = rollout.decode(tokenizer)
        log.add_completions(batch, [texts[j * k:(j + 1) * k] for j in range(len(batch))])
        extra: dict[str, list] = {}
        tools.reward_inputs(rollout, [None] * len(texts), extra)  # each completion's environment, if any
        seen = None if tools.observations is None else [  # each prompt as the dataset would hold it
            with_observation(rows[batch[j // k]][prompt_column], observation)
            for j, observation in enumerate(tools.observations)]
        _score(batch, rows, reward_funcs, reward_weights, log, settings, prompt_column, answer_column, extra, seen)
        bar.update(len(batch))
    bar.close()
    unscored = [i for i in sorted(log.completions) if i not in log.scored]  # sampled before a crash
    if unscored and toolbox.environment_factory is not None:
        raise BootstrapError(f"rows {unscored[:5]} were sampled before a crash, with environments whose episodes are "
                             f"gone: remove {log.path} to sample this iteration again")
    for start in range(0, len(unscored), size):
        _score(unscored[start:start + size], rows, reward_funcs, reward_weights, log, settings, prompt_column,
               answer_column)


def _score(batch: list[int], rows: Sequence[dict[str, Any]], reward_funcs: Sequence[RewardFunction],
           reward_weights: Sequence[float], log: SamplesLog, settings: BootstrapSettings, prompt_column: str,
           answer_column: str, extra: dict[str, list] | None = None, seen: list[Text] | None = None) -> None:
    """Score the logged completions of ``batch`` (and their rewrites) and log the scores. ``extra``: columns with a
    value per completion (``environments``); ``seen``: each completion's prompt as the model read it, logged."""
    picked = [rows[i] for i in batch]
    texts = [t for i in batch for t in log.completions[i]]
    owner = [j for j, i in enumerate(batch) for _ in log.completions[i]]
    candidates = texts if settings.rewrite == "none" else [rewrite_to_tags(t) for t in texts]
    judged = [j for j, c in enumerate(candidates) if c is not None]  # a rewrite without an answer is not scored
    names = reward_column_names(picked, prompt_column, answer_column)
    columns = {name: [picked[owner[j]].get(key) for j in judged] for name, key in names.items()}
    columns.update({name: [values[j] for j in judged] for name, values in (extra or {}).items()})
    prompts = [picked[owner[j]][prompt_column] for j in judged]  # as the dataset holds them (as TRL)
    per_function: dict[str, list[float | None]] = {reward_name(fn): [None] * len(texts) for fn in reward_funcs}
    if judged:
        _, scores, _ = score_steps(reward_funcs, reward_weights, prompts, [candidates[j] for j in judged], columns)
        for name, values in scores.items():
            for j, value in zip(judged, values.tolist()):
                per_function[name][j] = None if value != value else float(value)  # NaN: the function did not apply
    records, start = [], 0
    for i in batch:  # each row's completions lie together
        end = start + len(log.completions[i])
        records.append({"row": i, "candidates": candidates[start:end],
                        "scores": {name: values[start:end] for name, values in per_function.items()},
                        **({} if seen is None else {"prompts": seen[start:end]})})
        start = end
    log.add_scores(records)


def select(rows: Sequence[dict[str, Any]], logs: Sequence[SamplesLog], settings: BootstrapSettings,
           judge: Sequence[str], *, prompt_column: str = "prompt", answer_column: str = "answer",
           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The kept rows from the logs of every iteration so far, in row order (for each prompt, earlier iterations'
    samples first), and the counts of the summary."""
    kept: list[dict[str, Any]] = []
    counts = {"prompts": len(rows), "samples": 0, "correct": 0, "no_answer": 0, "disagreed": 0, "duplicates": 0,
              "over_cap": 0, "rewritten": 0}
    per_prompt = [0] * len(rows)
    for i, row in enumerate(rows):
        seen: set[str] = set()
        for iteration, log in enumerate(logs, start=1):
            record = log.scored.get(i)
            if record is None:
                continue
            given = [given_answer(c) if c is not None else None for c in record["candidates"]]
            for j, (sample, candidate) in enumerate(zip(log.completions[i], record["candidates"])):
                counts["samples"] += 1
                if candidate is None:
                    counts["no_answer"] += 1
                    continue
                scores = {name: values[j] for name, values in record["scores"].items()}
                if not all(scores[name] is not None and scores[name] >= settings.min_score for name in judge):
                    continue
                counts["correct"] += 1
                if given.count(given[j]) < settings.min_agreement:
                    counts["disagreed"] += 1
                    continue
                key = " ".join(candidate.split())
                if key in seen:
                    counts["duplicates"] += 1
                    continue
                if per_prompt[i] >= settings.keep_per_prompt:
                    counts["over_cap"] += 1
                    continue
                seen.add(key)
                per_prompt[i] += 1
                counts["rewritten"] += candidate != sample
                # the prompt with the observation the model saw, where an environment's reset gave one
                prompt = record["prompts"][j] if "prompts" in record else row[prompt_column]
                out = {"prompt": prompt, "completion": candidate, "row": i, "iteration": iteration,
                       "sample": sample, "rewards": scores}
                if answer_column in row:
                    out["answer"] = row[answer_column]
                kept.append(out)
    covered = sum(n > 0 for n in per_prompt)
    counts.update(kept=len(kept), covered_prompts=covered, coverage=covered / max(1, len(rows)),
                  correct_rate=counts["correct"] / max(1, counts["samples"]),
                  kept_rate=len(kept) / max(1, counts["samples"]),
                  kept_per_prompt={str(n): per_prompt.count(n) for n in range(settings.keep_per_prompt + 1)})
    return kept, counts


def judge_names(reward_funcs: Sequence[RewardFunction], judge: Sequence[str] | None) -> list[str]:
    """The reward functions (by the names they are logged under) that judge a sample correct: ``judge``, checked
    against the run's functions, or the first of them."""
    names = [reward_name(fn) for fn in reward_funcs]
    if not names:
        raise BootstrapError("bootstrap needs reward_funcs to judge the samples")
    for name in judge or []:
        if name not in names:
            raise BootstrapError(f"judge {name!r} is not one of the run's reward functions ({', '.join(names)})")
    return list(judge) if judge else names[:1]


def fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    """A short hash of the rows, so that a log is never resumed on other data."""
    return hashlib.sha256(json.dumps(list(rows), sort_keys=True, default=str).encode()).hexdigest()[:16]


def log_path(output: Path, iteration: int) -> Path:
    return output.with_name(f"{output.stem}.samples-{iteration}.jsonl")


def bootstrap(
    rows: Sequence[dict[str, Any]], reward_funcs: Sequence[RewardFunction], reward_weights: Sequence[float],
    output: str | Path, settings: BootstrapSettings, *, make_engine: Callable[[str], tuple],
    model: str, iterations: int = 1, train: Callable[[Path, int], str] | None = None,
    sampling: dict[str, Any] | None = None, progress: bool = True, keywords: Sequence[str] = (),
    source: str = "dataset",
) -> dict[str, Any]:
    """Bootstrap a cold start into ``output`` (JSONL) and its summary into ``OUTPUT.summary.json``; return the
    summary. ``make_engine(model)``: the engine and tokenizer that sample ``model`` (and the ToolBox of the tools
    and environments the completions use; ``keywords``: what those add to the reward functions' keywords). With
    ``iterations`` > 1, ``train(kept_file, iteration)`` fine-tunes on the rows kept so far and returns the model the
    next iteration samples, as training renders its prompts (that model has learned the format; no instruction, no
    demonstrations). ``sampling``: :func:`sample_and_score`'s keywords (columns, lengths, temperature, seed, ...);
    ``source``: the rows' name in errors."""
    output, sampling = Path(output), dict(sampling or {})
    columns = (sampling.get("prompt_column", "prompt"), sampling.get("answer_column", "answer"))
    names = reward_column_names(rows, *columns)
    needed = [k for k in check_reward_functions(reward_funcs, [*names, *keywords], source) if k not in keywords]
    check_columns(rows, [columns[0], *(names[k] for k in needed)], source=source)
    judge = judge_names(reward_funcs, settings.judge)
    if iterations > 1 and train is None:
        raise BootstrapError("iterations > 1 needs a way to fine-tune between them")
    summary: dict[str, Any] = {"output": str(output), "judge": judge, "min_score": settings.min_score,
                               "iterations": []}
    logs: list[SamplesLog] = []
    for iteration in range(1, iterations + 1):
        started = time.perf_counter()
        # What the samples and their scores depend on (not which are kept: choosing anew needs no sampling).
        header = {"iteration": iteration, "model": model, "rows": fingerprint(rows),
                  "reward_funcs": [reward_name(fn) for fn in reward_funcs], "samples": settings.samples,
                  "instruction": settings.instruction, "few_shot": settings.few_shot, "rewrite": settings.rewrite,
                  **sampling}
        log = SamplesLog(log_path(output, iteration), header)
        engine, tokenizer, *toolbox = make_engine(model)
        sample_and_score(engine, tokenizer, rows, reward_funcs, reward_weights, log, settings,
                         prompting=iteration == 1, progress=progress, toolbox=toolbox[0] if toolbox else ToolBox.NONE,
                         **sampling)
        del engine  # a vLLM engine's memory, before the next iteration's fine-tuning
        logs.append(log)
        _, alone = select(rows, [log], settings, judge, prompt_column=columns[0], answer_column=columns[1])
        kept, counts = select(rows, logs, settings, judge, prompt_column=columns[0], answer_column=columns[1])
        _write_jsonl(output, kept)
        summary["iterations"].append({"iteration": iteration, "model": model, **alone,
                                      "seconds": time.perf_counter() - started})
        summary.update(counts)
        output.with_name(f"{output.stem}.summary.json").write_text(json.dumps(summary, indent=2))
        if iteration < iterations:
            if not kept:
                raise BootstrapError(f"round {iteration} kept no sample: nothing to fine-tune on (try more "
                                     "--num_generations, an --instruction or --few_shot demonstrations, --rewrite "
                                     "tags, or a lower --min_score)")
            model = train(output, iteration)  # type: ignore[misc]
    return summary


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Written beside and renamed into place: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    partial.replace(path)
