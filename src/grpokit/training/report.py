"""``grpokit report RUN_DIR``: one self-contained HTML page — the config, the learning curves, and the
sampled completions of every step, best and worst of each group highlighted.

No external resources: the curves are an embedded PNG (matplotlib, ``grpokit[plot]``), the styling and
the step filter are inline. Completions are model output, so every piece of text is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from grpokit.training.evaluation import reward_gaming_alarm, reward_level
from grpokit.training.plots import plot_run, read_metrics

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; max-width: 60em; }
tr.best td { background: #e6f5e6; } tr.worst td { background: #fbe9e9; }
.alarm { background: #fbe9e9; border: 2px solid #c33; padding: 0.6em 1em; }
.config { columns: 3; font-size: 0.8em; font-family: ui-monospace, monospace; }
img { max-width: 100%; }
"""

SCRIPT = """
function showStep(value) {
  for (const row of document.querySelectorAll('#completions tbody tr')) {
    row.hidden = value !== 'all' && row.dataset.step !== value;
  }
}
"""


def _rows_by_group(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """Each record with its class: ``best``/``worst`` in its (step, prompt) group when rewards differ."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["step"], json.dumps(record["prompt"])), []).append(record)
    marked = []
    for group in groups.values():
        rewards = [r["reward"] for r in group]
        best, worst = max(rewards), min(rewards)
        for record in group:
            label = ""
            if best != worst:
                label = "best" if record["reward"] == best else "worst" if record["reward"] == worst else ""
            marked.append((record, label))
    return marked


def _held_out(metrics: list[dict[str, Any]], config: dict[str, Any]) -> tuple[str, str]:
    """The held-out evaluations as an HTML table, and a banner for each that raised the reward-gaming alarm
    (both empty for a run without held-out rows)."""
    evals = [m for m in metrics if m.get("eval_accuracy") is not None]
    if not evals:
        return "", ""
    span = config.get("eval_every") or max(1, int(config.get("max_steps", 4)) // 4)  # as the run computed it
    keys = [k for k in dict.fromkeys(k for m in evals for k in m) if k.startswith("eval_")
            and k not in ("eval_prompts", "eval_alarm")]
    header = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", "training reward", *keys, "alarm"])
    body, banners = [], []
    for m in evals:
        level = reward_level(metrics, m["step"], span)
        cells = [str(m["step"]), "—" if level is None else f"{level:.3f}",
                 *("—" if m.get(k) is None else f"{m[k]:.3f}" for k in keys), "yes" if m.get("eval_alarm") else ""]
        body.append(f'<tr class="{"worst" if m.get("eval_alarm") else ""}">'
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        if m.get("eval_alarm"):
            upto = [h for h in metrics if h["step"] <= m["step"]]
            why = reward_gaming_alarm(upto, span, config.get("eval_alarm_drop", 0.05)) or "eval_alarm was logged"
            banners.append(f'<p class="alarm"><b>Reward gaming?</b> At step {m["step"]}: {html.escape(why)}.</p>')
    table = (f"<h2>Held-out evaluation</h2><p>{int(evals[-1].get('eval_prompts', 0))} held-out prompts; the training "
             f"reward is the mean over the {span} steps up to each evaluation.</p>"
             f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>")
    return "".join(banners), table


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the report (default ``RUN_DIR/report.html``) and return its path."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    config_path = run_dir / "config.yaml"
    config = config_path.read_text() if config_path.is_file() else ""
    completions_path = run_dir / "completions.jsonl"
    lines = completions_path.read_text().splitlines() if completions_path.is_file() else []
    records = [json.loads(line) for line in lines if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        png = base64.b64encode(plot_run(run_dir, tmp).read_bytes()).decode()

    esc = html.escape
    functions = [k for k in (records[0] if records else {}) if k not in
                 {"step", "prompt", "completion", "reward", "advantage", "steps"}]
    header = "".join(f"<th>{esc(name)}</th>" for name in ["step", "prompt", "completion", "reward", "advantage",
                                                          *functions])
    body = []
    for record, label in _rows_by_group(records):
        prompt = record["prompt"] if isinstance(record["prompt"], str) else json.dumps(record["prompt"])
        cells = [str(record["step"]), esc(prompt), esc(record["completion"]), f"{record['reward']:.3f}",
                 f"{record['advantage']:+.3f}"]
        cells += ["—" if record.get(name) is None else f"{record[name]:.3f}" for name in functions]
        classes = ["", "text", "text"] + [""] * (len(cells) - 3)
        tds = "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>" for c, v in zip(classes, cells))
        body.append(f'<tr class="{label}" data-step="{record["step"]}">{tds}</tr>')
    steps = sorted({record["step"] for record in records})
    options = "".join(f'<option value="{s}">step {s}</option>' for s in steps)
    settings = (yaml.safe_load(config) if config else None) or {}
    banners, held_out = _held_out(metrics, settings)
    last = next((m for m in reversed(metrics) if "reward" in m), metrics[-1])  # an evaluation's line has no reward
    summary = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward", "accuracy", "format_rate", "kl")
                        if isinstance(last.get(k), (int, float)))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>grpokit run: {esc(run_dir.resolve().name)}</title>
<style>{STYLE}</style><script>{SCRIPT}</script></head>
<body onload="showStep(document.getElementById('step').value)">
<h1>grpokit run: {esc(run_dir.resolve().name)}</h1>
<p>{last.get("step", 0)} steps; last step: {esc(summary)}.</p>
{banners}
<h2>Learning curves</h2>
<img alt="learning curves" src="data:image/png;base64,{png}">
{held_out}
<h2>Sampled completions</h2>
<p>Best (green) and worst (red) reward within each prompt's logged completions.
<label>Show <select id="step" onchange="showStep(this.value)"><option value="all">all steps</option>
{options}</select></label></p>
<table id="completions"><thead><tr>{header}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
<h2>Config</h2>
<pre class="config">{esc(config)}</pre>
</body></html>
"""
    path = Path(output) if output is not None else run_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
