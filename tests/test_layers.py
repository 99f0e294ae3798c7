"""The package's shape, read from its source with ``ast`` (nothing is imported): imports go one way, from a lower
layer to a higher one, with no cycle; no source file is over 400 lines; few modules at the top. And the tests'
own rule: no test module imports another (shared code is in helpers.py, fixtures in conftest.py)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "grpokit"
# Lowest first: a module may import its own layer and the ones before it, never one after it. A name covers the
# module of that name and, for a subpackage, every module in it.
LAYERS = [("grpokit.user_code",), ("grpokit.sandbox",), ("grpokit.runtime",), ("grpokit.core",), ("grpokit.config",),
          ("grpokit.data",), ("grpokit.models",), ("grpokit.rollout",), ("grpokit.rewards",), ("grpokit.training",),
          ("grpokit.serving",), ("grpokit.agents",), ("grpokit.tasks",), ("grpokit.resolve",), ("grpokit.from_config",),
          ("grpokit.algorithms",), ("grpokit.trl",), ("grpokit.cli",)]
# The public API and the entry point sit above every layer: they may import anything, and nothing in a layer may
# import them.
ABOVE_ALL = {"grpokit", "grpokit.__main__"}
MAX_LINES = 400
MAX_TOP_LEVEL_MODULES = 10


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module an imported name runs: itself if it is one, else the closest enclosing module or package."""
    while name not in SOURCES and "." in name:
        name = name.rpartition(".")[0]
    return name


def grpokit_imports(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import of grpokit in ``module``: at the top, inside functions, under
    ``if TYPE_CHECKING:``, relative ones, and ``importlib.import_module("grpokit....")``."""
    path = SOURCES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from A import b` runs A.b when b is a module, else A (b is a name A defines)
            found += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base, node.lineno)
                      for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, node.lineno))
    ours = [(resolve(name), line) for name, line in found if name == "grpokit" or name.startswith("grpokit.")]
    return list(dict.fromkeys(ours))  # `from A import b, c`: one edge


GRAPH = {module: grpokit_imports(module) for module in SOURCES}


def where(module: str, line: int) -> str:
    return f"{SOURCES[module].relative_to(ROOT)}:{line}"


def layer(module: str) -> int | None:
    """The module's place in LAYERS (len(LAYERS) for the modules above all); None for a module in no layer."""
    if module in ABOVE_ALL:
        return len(LAYERS)
    return next((rank for rank, names in enumerate(LAYERS)
                 if any(module == name or module.startswith(name + ".") for name in names)), None)


def cycles() -> list[list[str]]:
    """The strongly connected components of the import graph that hold a cycle (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target, _ in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or any(target == module for target, _ in GRAPH[module]):
                found.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    return found


def test_the_parser_sees_every_kind_of_import():
    """A check of the checker on a module known to import in each way it reads (relative imports aside)."""
    assert len(SOURCES) > 30 and "grpokit.core.objective" in SOURCES
    assert {target for target, _ in GRAPH["grpokit"]} > {"grpokit.config", "grpokit.core.objective"}
    commands = [target for target, _ in GRAPH["grpokit.cli.commands"]]
    assert "grpokit.from_config" in commands  # inside a function


def test_no_import_cycles():
    problems = []
    for component in cycles():
        members = set(component)
        edges = [f"    {source} -> {target} ({where(source, line)})"
                 for source in component for target, line in GRAPH[source] if target in members]
        problems.append(f"cycle among {', '.join(component)}:\n" + "\n".join(edges))
    assert not problems, f"{len(problems)} import cycle(s):\n" + "\n".join(problems)


def test_no_module_imports_a_higher_layer():
    order = " < ".join("/".join(names) for names in LAYERS)
    problems = [f"{module} is in no layer ({where(module, 1)}); the order is {order}"
                for module in SOURCES if layer(module) is None]
    for module, imports in GRAPH.items():
        if module in ABOVE_ALL or layer(module) is None:
            continue
        problems += [f"{where(module, line)}: {module} (layer {layer(module)}) imports {target} (layer "
                     f"{'above all' if target in ABOVE_ALL else layer(target)})"
                     for target, line in imports if layer(target) is not None and layer(target) > layer(module)]
    assert not problems, f"{len(problems)} import(s) against the layer order {order}:\n" + "\n".join(problems)


def test_no_source_file_is_over_400_lines():
    lengths = {path: len(path.read_text().splitlines()) for path in SOURCES.values()}
    over = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in sorted(lengths.items()) if n > MAX_LINES]
    assert not over, f"source files over {MAX_LINES} lines:\n" + "\n".join(over)


def test_few_modules_at_the_top_of_the_package():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in src/grpokit: {', '.join(top)}"


def test_no_test_module_imports_another():
    """Also in the code of scripts that tests run in subprocesses, which is why the text is searched, not parsed."""
    pattern = re.compile(r"^\s*(?:from|import)\s+(test_\w+|conftest)\b", flags=re.M)
    found = [f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
             for path in sorted(ROOT.joinpath("tests").rglob("*.py")) for text in [path.read_text()]
             for m in pattern.finditer(text)]
    assert not found, "test modules import test modules (use helpers.py or a conftest fixture):\n" + "\n".join(found)
