"""grpokit.trl.GRPOTrainer: a TRL-style script (TRL's signature, a datasets.Dataset, TrainerCallbacks) training the
tiny model two steps; TRL's metric names in log_history and on_log; save_model; resume_from_checkpoint (and a new
run into a used output_dir refused)."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback, TrainerState

from grpokit.config import ConfigError
from grpokit.training.run_dir import OutputDirInUse
from grpokit.trl import GRPOConfig, GRPOTrainer
from grpokit.trl.convert import lora_settings, prompt_format, reward_functions
from helpers import ROWS, ones

TRL_NAMES = {"reward", "reward_std", "rewards/seen_state/mean", "completions/mean_length", "completions/clipped_ratio",
             "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
             "learning_rate", "loss", "grad_norm", "epoch", "step"}


class Recorder(TrainerCallback):
    """Every event, in order, with the global step; on_log's logs."""

    def __init__(self):
        self.events, self.logs = [], []

    def _record(name):
        def event(self, args, state, control, **kwargs):
            self.events.append((name, state.global_step))
            if name == "on_log":
                self.logs.append(dict(kwargs["logs"]))
        return event

    on_init_end = _record("on_init_end")
    on_train_begin = _record("on_train_begin")
    on_step_begin = _record("on_step_begin")
    on_step_end = _record("on_step_end")
    on_log = _record("on_log")
    on_save = _record("on_save")
    on_train_end = _record("on_train_end")


def seen_state(prompts, completions, trainer_state, **kwargs):
    seen_state.states.append((type(trainer_state), trainer_state.global_step))
    return ones(prompts, completions)


def script_args(output_dir, **overrides):
    """A TRL script's settings at the tiny model's scale (float32 on the CPU)."""
    values = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, save_steps=1,
                  learning_rate=1e-2, report_to="none", disable_tqdm=True)
    return GRPOConfig(**{**values, **overrides})


def test_two_steps_through_trl_api(tiny_model_dir, tmp_path):
    seen_state.states = []
    recorder = Recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=seen_state, args=script_args(tmp_path / "out"),
                          train_dataset=Dataset.from_list(ROWS), callbacks=[recorder])
    output = trainer.train()

    assert output.global_step == trainer.state.global_step == 2 and trainer.state.max_steps == 2
    steps = [(name, step) for name, step in recorder.events]
    assert steps == [("on_init_end", 0), ("on_train_begin", 0),
                     ("on_step_begin", 0), ("on_step_end", 1), ("on_log", 1), ("on_save", 1),
                     ("on_step_begin", 1), ("on_step_end", 2), ("on_log", 2), ("on_save", 2),
                     ("on_train_end", 2)]
    logged = [entry for entry in trainer.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert all(TRL_NAMES <= set(entry) for entry in logged)
    assert all(TRL_NAMES - {"step"} <= set(logs) for logs in recorder.logs)
    assert logged[0]["learning_rate"] == pytest.approx(5e-3)  # linear decay, read after the step (as TRL)
    assert trainer.log_history[-1]["train_loss"] == pytest.approx(output.training_loss)
    # reward functions get the TrainerState the callbacks see: optimizer steps done before the batch
    assert seen_state.states == [(TrainerState, 0), (TrainerState, 1)]

    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_resume_from_checkpoint_continues_the_state(tiny_model_dir, tmp_path):
    rows = Dataset.from_list(ROWS)
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=script_args(tmp_path / "out"),
                train_dataset=rows).train()
    recorder = Recorder()
    resumed = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[ones], args=script_args(tmp_path / "out",
                                                                                          max_steps=3),
                          train_dataset=rows, callbacks=[recorder])
    files = lambda: {p: p.read_bytes() for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    with pytest.raises(OutputDirInUse, match=r"holds a run .*train\(resume_from_checkpoint=True\)"):
        resumed.train()  # a new run there would write over the first: refused, nothing written
    assert files() == before
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert [entry["step"] for entry in resumed.log_history if "loss" in entry] == [1, 2, 3]
    assert [name for name, step in recorder.events if name == "on_step_end"] == ["on_step_end"]


def test_a_callback_stops_training(tiny_model_dir, tmp_path):
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=script_args(tmp_path / "out",
                                                                                        max_steps=4),
                          train_dataset=ROWS, callbacks=[Stop()])
    trainer.train()
    assert trainer.state.global_step == 1


def test_push_to_hub_without_the_hub_says_so(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=script_args(tmp_path / "out"),
                          train_dataset=ROWS)
    with pytest.raises(RuntimeError, match="push_to_hub: could not upload .* to the Hub repo 'out'"):
        trainer.push_to_hub()
    assert (tmp_path / "out" / "config.json").is_file()  # saved before the upload


def test_arguments_grpokit_cannot_honour_are_refused(tiny_model_dir, tmp_path):
    args = script_args(tmp_path / "out")
    with pytest.raises(ConfigError, match="optimizers"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=args, train_dataset=ROWS,
                    optimizers=(object(), None))
    with pytest.raises(ConfigError, match="'prompt' column"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=args, train_dataset=[{"question": "x"}])


def test_trl_inputs_translate():
    assert reward_functions("org/reward-model") == ["model:org/reward-model"]
    assert reward_functions([ones, "model:dir"]) == [ones, "model:dir"]
    assert prompt_format([{"prompt": "text"}]) is False
    assert prompt_format([{"prompt": [{"role": "user", "content": "hi"}]}]) is None
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    assert lora_settings(lora) == {"lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.05,
                                   "lora_target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(ConfigError, match="use_dora"):
        lora_settings(peft.LoraConfig(r=4, use_dora=True))
    assert lora_settings(peft.LoraConfig(r=4, target_modules="all-linear"))["lora_target_modules"] == ["all-linear"]
    with pytest.raises(ConfigError, match="a pattern"):
        lora_settings(peft.LoraConfig(r=4, target_modules=".*proj"))


def test_all_linear_adapts_every_linear_layer_but_the_head(tiny_model_dir):
    import types

    from grpokit.models.lora import with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), types.SimpleNamespace(
        lora_rank=2, lora_alpha=4.0, lora_dropout=0.0, lora_target_modules=["all-linear"]))
    adapted = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_conversational_dataset_is_rendered_with_the_chat_template(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}={% endif %}")
    rows = [{"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]} for row in ROWS]
    seen = []

    def prompts_seen(prompts, completions, **kwargs):
        seen.extend(prompts)
        return ones(prompts, completions)

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=prompts_seen, processing_class=tokenizer,
                          args=script_args(tmp_path / "out", max_steps=1), train_dataset=Dataset.from_list(rows))
    assert trainer.grpokit_trainer.sampler.prompts[0] == ROWS[0]["prompt"] + " ="
    trainer.train()
    assert seen and all(isinstance(p, list) and p[0]["role"] == "user" for p in seen)  # as the dataset holds them


def test_evaluation_scores_eval_prompts_and_changes_no_training_draw(tiny_model_dir, tmp_path):
    scored = []

    def recorded(prompts, completions, **kwargs):
        scores = ones(prompts, completions)
        scored.append((list(prompts), scores))
        return scores

    eval_rows = [{"prompt": f"Eval {i}:", "answer": "1"} for i in range(3)]
    recorder = Recorder()
    recorder.on_evaluate = lambda args, state, control, metrics, **kw: recorder.events.append(("on_evaluate",
                                                                                              state.global_step))
    args = script_args(tmp_path / "eval", eval_strategy="steps", eval_steps=2, eval_on_start=True,
                       num_generations_eval=2, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=recorded, args=args, train_dataset=ROWS,
                          eval_dataset=Dataset.from_list(eval_rows), callbacks=[recorder])
    trainer.train()
    plain = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, args=script_args(tmp_path / "plain"),
                        train_dataset=ROWS)
    plain.train()
    for a, b in zip(trainer.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)  # evaluating drew nothing from the training streams

    assert [e for e in recorder.events if e[0] == "on_evaluate"] == [("on_evaluate", 0), ("on_evaluate", 2)]
    evals = [entry for entry in trainer.log_history if "eval_reward" in entry]
    assert [entry["step"] for entry in evals] == [0, 2]
    # the last evaluation: 3 prompts × 2 completions, in rounds of 2 prompts (4 completions per device ÷ 2)
    rounds = [(p, s) for p, s in scored if p[0].startswith("Eval")][-2:]
    assert [len(p) for p, _ in rounds] == [4, 2] and {p for ps, _ in rounds for p in ps} == {
        row["prompt"] for row in eval_rows}
    values = [v for _, s in rounds for v in s]
    assert evals[-1]["eval_reward"] == pytest.approx(sum(values) / 6)
    assert evals[-1]["eval_rewards/recorded/mean"] == pytest.approx(sum(values) / 6)
    assert evals[-1]["eval_reward_std"] == pytest.approx(torch.tensor(values).std().item())
    assert {"eval_completions/mean_length", "eval_completions/clipped_ratio", "eval_frac_reward_zero_std",
            "eval_rewards/recorded/std"} <= set(evals[-1])
    # called directly, with its own set and prefix; several named sets each under their own
    again = trainer.evaluate(eval_rows[:1], metric_key_prefix="test")
    assert set(again) >= {"test_reward", "test_completions/mean_length"}
    both = trainer.evaluate({"a": eval_rows[:1], "b": eval_rows[1:]})
    assert "eval_a_reward" in both and "eval_b_reward" in both


def test_evaluation_needs_an_eval_dataset(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="eval_strategy='steps' needs an eval_dataset"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ones, train_dataset=ROWS,
                    args=script_args(tmp_path / "out", eval_strategy="steps"))


def test_shuffle_dataset_false_takes_the_prompts_in_the_datasets_order(tiny_model_dir, tmp_path):
    seen = []

    def prompts_seen(prompts, completions, **kwargs):
        seen.extend(prompts[::4])  # one per group of 4
        return ones(prompts, completions)

    rows = ROWS[:3]  # 2 prompts per step: the second step wraps around to a second pass
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=prompts_seen, train_dataset=rows,
                args=script_args(tmp_path / "out", shuffle_dataset=False)).train()
    assert seen == [rows[0]["prompt"], rows[1]["prompt"], rows[2]["prompt"], rows[0]["prompt"]]


def test_chat_template_kwargs_reach_the_chat_template(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}{% if enable_thinking is false %}!{% else %}?"
                               "{% endif %}{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in ROWS]
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=ones, processing_class=tokenizer, train_dataset=rows,
                          args=script_args(tmp_path / "out", chat_template_kwargs={"enable_thinking": False}))
    assert trainer.grpokit_trainer.sampler.prompts[0] == ROWS[0]["prompt"] + "!"
    assert tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True).endswith("?")


def test_reward_functions_log_through_trls_log_metric_and_log_extra(tiny_model_dir, tmp_path):
    import json
    import re

    # TRL's "Example 6: Logging extra columns and metrics" (docs/source/grpo_trainer.md), as published
    def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
        extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        extracted = [m.group(1) if m else None for m in extracted]
        rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

        if log_extra:
            log_extra("golden_answer", list(ground_truth))
            log_extra("extracted_answer", [e or "[none]" for e in extracted])

        if log_metric:
            log_metric("accuracy", sum(rewards) / len(rewards))

        return rewards

    rows = [{"prompt": row["prompt"], "ground_truth": row["answer"]} for row in ROWS]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_func, train_dataset=rows,
                          args=script_args(tmp_path / "out", max_steps=1, log_completions=True))
    trainer.train()
    logged = [entry for entry in trainer.log_history if "loss" in entry][0]
    assert logged["accuracy"] == logged["rewards/reward_func/mean"]  # its own name, as TRL logs it
    records = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert records and all(r["extra"]["golden_answer"] == "1" and r["extra"]["extracted_answer"] == "[none]"
                           for r in records)

    def uneven(completions, log_extra, **kwargs):
        log_extra("short", [1])
        return [0.0] * len(completions)

    with pytest.raises(Exception, match=r"log_extra\('short', \.\.\.\): 1 values for 8 completions"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=uneven, train_dataset=ROWS,
                    args=script_args(tmp_path / "uneven", max_steps=1)).train()
