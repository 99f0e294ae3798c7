"""benchmarks/vs_trl.py's accounting: the FLOPs a step needs, this machine's matrix-multiply peak, each result's
summary and the markdown table (and ``--pool``: several results files as one sample)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def forward_flops(model_config, tokens: float, context: float) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens whose mean attention context is ``context``:
    2 per multiply-add of every projection and the LM head, plus QKᵀ and AV."""
    c = model_config
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_token = layers * (2 * h * (h + 2 * kv) + 2 * h * h + 2 * 3 * h * i + 4 * h * context) + 2 * h * c.vocab_size
    return tokens * per_token


def useful_flops(model_config, prompt_lengths: list[int], completion_lengths: list[float],
                 passes: float = 1 + 1 + 3) -> float:
    """Generation (each real token once, context = its position) + reference pass + policy forward and
    backward (3 × forward), over the non-padding tokens only; ``passes=3``: the update's alone."""
    total = 0.0
    for p, c in zip(prompt_lengths, completion_lengths):
        tokens = p + c
        total += forward_flops(model_config, tokens, context=tokens / 2) * passes
    return total


# ---- workers ---------------------------------------------------------------------------------------


def matmul_peak() -> dict:
    """Best GFLOP/s of a large square-ish matrix product and of a 32-row one (decode's shape), the best
    of MKL (``a @ b``) and oneDNN on packed weights (what grpokit decodes with on the CPU, where this CPU
    has that path), best of 10."""

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (m, k, n) in {"large": (2048, 1024, 1024), "rows32": (32, 1024, 4096)}.items():
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), m)
            except RuntimeError:  # no oneDNN path for this dtype on this CPU (bf16 without AVX-512): MKL only
                packed = None
            reps = max(3, int(2e9 / (2 * m * k * n)))
            best = float("inf")
            for _ in range(10):
                for onednn in (False, True) if packed is not None else (False,):
                    start = time.perf_counter()
                    for _ in range(reps):
                        if onednn:
                            torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
                        else:
                            a @ b
                    best = min(best, (time.perf_counter() - start) / reps)
            out[f"{str(dtype).split('.')[-1]}_{name}"] = 2 * m * k * n / best / 1e9
    return out


def step_tokens_per_s(raw: dict) -> float:
    """Generated tokens per second of whole steps: a trainer whose samples are shorter does less work per
    step, and seconds per step would count that as speed."""
    return sum(sum(c) for c in raw["completion_lengths"]) / sum(raw["step"])


def summarize(result: dict, model_config, peak_gflops: float) -> dict:
    step = result["step"]
    flops = [useful_flops(model_config, p, c) for p, c in zip(result["prompt_lengths"], result["completion_lengths"])]
    generated = [sum(c) for c in result["completion_lengths"]]
    total_time = sum(step)
    return {
        "s_per_step": {"min": min(step), "median": statistics.median(step), "max": max(step)},
        "generated_tokens_per_s": sum(generated) / sum(result["generate"]),
        "step_tokens_per_s": step_tokens_per_s(result),
        "phase_share": {k: sum(result[k]) / total_time for k in ("generate", "score_and_reference", "update")},
        "peak_rss_mb": result["peak_rss_mb"],
        "useful_gflops_per_s": sum(flops) / total_time / 1e9,
        "update_gflops_per_s": sum(useful_flops(model_config, p, c, passes=3) for p, c in zip(
            result["prompt_lengths"], result["completion_lengths"])) / sum(result["update"]) / 1e9,
        "fraction_of_peak": sum(flops) / total_time / 1e9 / peak_gflops,
        "peak_gflops": peak_gflops,
        "mean_completion_length": sum(generated) / sum(len(c) for c in result["completion_lengths"]),
    }


def pool(paths: list[str]) -> None:
    """Every timed step of the same (trainer, config, mode) in several results files, as one sample."""
    steps: dict[tuple, list[float]] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            steps.setdefault((r["config"], r["mode"], r["trainer"]), []).extend(r["raw"]["step"])
    for (config, mode, trainer), values in steps.items():
        trl = steps.get((config, mode, "trl"))
        ratio = ""
        if trainer.startswith("grpokit") and trl:
            ratio = f"  grpokit ÷ TRL {statistics.median(trl) / statistics.median(values):.2f}×"
        print(f"{config:5} {mode} {trainer:7} {statistics.median(values):.3f} s/step over {len(values)} steps{ratio}")


def table(paths: list[str]) -> None:
    """The Markdown table of earlier runs' results files, summaries recomputed from their raw steps."""
    for path in paths:
        saved = json.loads(Path(path).read_text())
        print(f"{path}:\n")
        print(markdown([{**r, "step_tokens_per_s": step_tokens_per_s(r["raw"])} for r in saved["results"]]))
        print()


def markdown(results: list[dict]) -> str:
    lines = ["| config | mode | trainer | s/step median [min, max] | speed ÷ TRL | generated tokens per step-second "
             "(÷ TRL) | peak RSS MB (÷ TRL) | generated tok/s | generate / score+ref / update "
             "| useful GFLOP/s (% of peak) | update GFLOP/s (% of peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["trainer"], r["config"], r["mode"]): r for r in results}
    for r in results:
        s, share = r["s_per_step"], r["phase_share"]
        trl = by.get(("trl", r["config"], r["mode"]))
        ours = r["trainer"].startswith("grpokit") and trl
        ratio = f"**{trl['s_per_step']['median'] / s['median']:.2f}×**" if ours else ""
        memory = f" (**{r['peak_rss_mb'] / trl['peak_rss_mb']:.2f}×**)" if ours else ""
        per_token = f" (**{r['step_tokens_per_s'] / trl['step_tokens_per_s']:.2f}×**)" if ours else ""
        update = r.get("update_gflops_per_s")
        update = f"{update:.0f} ({update / r['peak_gflops']:.0%})" if update and "peak_gflops" in r else ""
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['trainer']} | {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}] "
            f"| {ratio} | {r['step_tokens_per_s']:.1f}{per_token} | {r['peak_rss_mb']:.0f}{memory} "
            f"| {r['generated_tokens_per_s']:,.0f} "
            f"| {share['generate']:.0%} / "
            f"{share['score_and_reference']:.0%} / {share['update']:.0%} "
            f"| {r['useful_gflops_per_s']:.0f} ({r['fraction_of_peak']:.0%}) | {update} |"
        )
    return "\n".join(lines)
