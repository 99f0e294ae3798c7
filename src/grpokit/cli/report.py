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

from grpokit.cli.plots import plot_run, read_metrics

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; max-width: 60em; }
tr.best td { background: #e6f5e6; } tr.worst td { background: #fbe9e9; }
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
    last = metrics[-1]
    summary = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward", "accuracy", "format_rate", "kl")
                        if isinstance(last.get(k), (int, float)))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>grpokit run: {esc(run_dir.resolve().name)}</title>
<style>{STYLE}</style><script>{SCRIPT}</script></head>
<body onload="showStep(document.getElementById('step').value)">
<h1>grpokit run: {esc(run_dir.resolve().name)}</h1>
<p>{len(metrics)} steps; last step: {esc(summary)}.</p>
<h2>Learning curves</h2>
<img alt="learning curves" src="data:image/png;base64,{png}">
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
