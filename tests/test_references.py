"""Every dotted name of grpokit that the docs, the README and the source cite (``grpokit.training.evaluation``,
``grpokit.models.loading.save_pretrained``) names a module that exists and, past the module, something that module
defines or imports: a rename cannot leave a stale name behind. Read from the files; nothing is imported."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
CITED = re.compile(r"grpokit(?:\.[A-Za-z_]\w*)+")


def module_file(parts: list[str]) -> Path | None:
    path = SOURCE.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def exists(dotted: str) -> bool:
    """The longest prefix that is a module, and the next name defined, assigned or imported in it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        found = module_file(parts[:end])
        if found is not None:
            if end == len(parts):
                return True
            name = re.escape(parts[end])
            text = found.read_text()
            return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from\s+\S+\s+)?"
                                  rf"import\s[^\n]*\b{name}\b", text, re.M)) or parts[end].startswith("__")
    return False


def test_every_cited_name_exists():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(SOURCE.rglob("*.py"))]
    stale = sorted({f"{path.relative_to(ROOT)}: {name}" for path in files
                    for name in (m.group(0) for m in CITED.finditer(path.read_text())) if not exists(name)})
    assert not stale, "names that no longer exist:\n" + "\n".join(stale)
