"""Where a grpokit step spends its time, with the fast path off (the models' own forward) and on.

    python benchmarks/profile_step.py --config large

Builds vs_trl.py's model for ``--config``, runs two untimed warm-up steps, then profiles one step per
setting with ``torch.profiler`` and prints the step's phases and the operators with the most self CPU
time. The numbers behind "what moved" in docs/benchmarks.md. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

from vs_trl import BETA, CONFIGS, PROMPTS, G, build, rows


def main() -> None:
    import torch
    from torch.profiler import profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.config import GRPOConfig
    from grpokit.trainer import GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="large", choices=list(CONFIGS))
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        build(args.config, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        for fast in (False, True):
            config = GRPOConfig.from_dict({
                "model": tmp, "output_dir": str(Path(tmp) / "run"), "prompts_per_step": PROMPTS,
                "num_generations": G, "max_completion_length": CONFIGS[args.config][1], "beta": BETA,
                "learning_rate": 1e-6, "aggregation": "token", "micro_batch_size": PROMPTS * G, "seed": 0,
                "progress_bar": False, "log_completions": 0, "fast_path": fast,
                "mixed_precision": args.mixed_precision,
            })
            trainer = GRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer, train_dataset=rows())
            for _ in range(2):
                trainer.training_step()
            with profile() as prof:
                metrics = trainer.training_step()
            phases = {k: round(metrics[k], 3) for k in
                      ("time_generate", "time_score", "time_frozen_logprobs", "time_update", "time_step")}
            print(f"\n== fast_path: {str(fast).lower()} ({args.config}, mixed_precision {args.mixed_precision}) "
                  f"{phases}, mean completion length {metrics['completion_length_mean']:.1f}")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                              max_name_column_width=48)
            print(table)


if __name__ == "__main__":
    main()
