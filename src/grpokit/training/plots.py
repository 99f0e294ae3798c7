"""``grpokit plot RUN_DIR``: learning curves of a run as PNG, from the ``metrics.jsonl`` that :mod:`.runlog` writes.

Needs matplotlib (``pip install grpokit[plot]``); everything else in grpokit runs without it.
"""

from __future__ import annotations

import json
from pathlib import Path

# (title, metrics drawn as lines, y label); a panel is drawn when at least one of its metrics was logged.
PANELS = [
    ("reward", ["reward", "rewards/*"], "mean reward"),
    ("held-out evaluation", ["eval_accuracy", "eval_sampled_accuracy", "eval_pass@*"], "rate"),
    ("accuracy and format", ["accuracy", "format_rate"], "rate"),
    ("KL to the reference", ["kl"], "per-token KL"),
    ("clip fractions", ["clipfrac_low", "clipfrac_high"], "token share"),
    ("entropy", ["entropy"], "nats per token"),
    ("completion length", ["completion_length_mean", "completion_length_min", "completion_length_max"], "tokens"),
    ("groups without signal, truncations", ["frac_zero_std_groups", "truncated_frac"], "share"),
    ("value model (PPO)", ["value_loss", "explained_variance"], ""),
]
TIME_SPLIT = ["time_generate", "time_score", "time_frozen_logprobs", "time_update"]


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a grpokit run directory?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write ``curves.png`` (one panel per group of metrics, and the time split of a step) into
    ``output`` (default: ``RUN_DIR/plots``); return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("grpokit plot needs matplotlib: pip install 'grpokit[plot]'") from None

    rows = read_metrics(run_dir)
    steps = [row["step"] for row in rows]
    logged = list(dict.fromkeys(key for row in rows for key in row))

    def series(pattern: str) -> list[str]:
        if pattern.endswith("*"):
            return [key for key in logged if key.startswith(pattern[:-1])]
        return [pattern] if pattern in logged else []

    panels = [(title, [k for p in patterns for k in series(p)], label) for title, patterns, label in PANELS]
    panels = [panel for panel in panels if panel[1]]
    columns = 3
    rows_of_panels = (len(panels) + 1 + columns - 1) // columns
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(5 * columns, 3.4 * rows_of_panels),
                             constrained_layout=True, squeeze=False)
    flat = list(axes.flat)
    alarms = [row["step"] for row in rows if row.get("eval_alarm")]  # reward gaming suspected at these evaluations
    for ax, (title, keys, label) in zip(flat, panels):
        for key in keys:
            ys = [row.get(key) for row in rows]
            points = [(s, y) for s, y in zip(steps, ys) if y is not None]
            ax.plot(*zip(*points), label=key, marker="o" if len(points) < len(rows) else None, markersize=3)
        if title in ("reward", "held-out evaluation"):
            for step in alarms:
                ax.axvline(step, color="red", alpha=0.6, linestyle="--",
                           label="reward gaming?" if step == alarms[0] else None)
            if alarms and len(keys) == 1:
                ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    ax = flat[len(panels)]
    parts = [key for key in TIME_SPLIT if key in logged]
    ax.stackplot(steps, [[row.get(key, 0.0) for row in rows] for key in parts],
                 labels=[key.removeprefix("time_") for key in parts])
    ax.set_title("seconds per step, by phase")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper left")
    for extra in flat[len(panels) + 1:]:
        extra.axis("off")
    fig.suptitle(f"{Path(run_dir).resolve().name}: {max(steps)} steps")
    out_dir = Path(output) if output is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
