"""The samples log of ``grpokit bootstrap`` (:mod:`grpokit.algorithms.bootstrap`): one iteration's completions and
their scores, appended as they are made and flushed to disk, so that nothing sampled is lost on a crash and the same
command run again goes on from it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class BootstrapError(ValueError):
    """A bootstrap that cannot go on as asked (its log from another setting, a judge that is no reward function)."""


class SamplesLog:
    """One iteration's samples and scores, appended as they are made: a header line (the settings it was sampled
    with), then ``{"row", "completions"}`` and ``{"row", "scores", "candidates"}`` lines. Reopening it with other
    settings is refused; a line cut short by a crash is dropped."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path, self.completions, self.scored = path, {}, {}
        lines = path.read_text().splitlines() if path.is_file() else []
        records = []
        for number, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines) - 1:
                    raise BootstrapError(f"{path}: line {number + 1} is not JSON (the log is damaged; delete it "
                                         "to sample again)") from None
                # the last line, cut short by a crash: drop it
                path.write_text("".join(line + "\n" for line in lines[:number]))
        header = json.loads(json.dumps(header))  # as the log holds it
        if records and records[0].get("bootstrap") != header:
            why = _difference(records[0].get("bootstrap"), header)
            raise BootstrapError(f"{path} was sampled with other settings ({why}); delete it, or choose another "
                                 "--output")
        if not records:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._append([{"bootstrap": header}])
        for record in records[1:]:
            if "completions" in record:
                self.completions[record["row"]] = record["completions"]
            else:
                self.scored[record["row"]] = record

    def _append(self, records: list[dict[str, Any]]) -> None:
        with open(self.path, "a") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
            handle.flush()
            os.fsync(handle.fileno())

    def add_completions(self, rows: Sequence[int], completions: Sequence[list[str]]) -> None:
        self._append([{"row": r, "completions": c} for r, c in zip(rows, completions)])
        self.completions.update(zip(rows, completions))

    def add_scores(self, records: list[dict[str, Any]]) -> None:
        self._append(records)
        self.scored.update((r["row"], r) for r in records)


def _difference(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "not a bootstrap log"
    keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    return ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys[:3])
