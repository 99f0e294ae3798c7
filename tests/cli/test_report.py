"""grpokit report: one self-contained page with the config, the curves and every logged completion
(model output escaped), checked in a real headless browser when one is installed."""

import json
import shutil
import subprocess

import pytest

from grpokit.cli.main import main
from helpers import write_config

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.fixture
def report(tmp_path, tiny_model_dir, data_file):  # noqa: F811
    path = write_config(tmp_path, tiny_model_dir, data_file, log_completions=4)
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    # a hostile completion, as a model could write it
    records = (run / "completions.jsonl").read_text().splitlines()
    hostile = json.loads(records[0]) | {"completion": "<script>alert('pwned')</script><b>bold</b>"}
    (run / "completions.jsonl").write_text("\n".join([json.dumps(hostile), *records[1:]]) + "\n")
    assert main(["report", str(run)]) == 0
    return run / "report.html", len(records)


def test_the_page_holds_config_curves_and_completions(report):
    path, count = report
    page = path.read_text()
    assert page.count('<tr class="') == count  # one row per logged completion
    assert "data:image/png;base64," in page and "prompts_per_step: 2" in page
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in page
    assert "http://" not in page and "https://" not in page  # self-contained


@pytest.mark.skipif(BROWSER is None, reason="no chromium here (CI installs it: apt-get install chromium)")
def test_the_page_loads_in_a_headless_browser_without_console_errors(report):
    path, count = report
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []  # the page logs nothing: any console line is an error
    dom = done.stdout
    assert 'id="completions"' in dom and dom.count("data-step=") == count
    assert " hidden" not in dom  # the step filter ran at load and shows every step
