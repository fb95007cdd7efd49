"""Imports flow one way: from the entry points down to data and models, never back up.

Every ``npuq`` import in ``src/npuq`` (at module level or inside a function) is checked
against the layer table below; a package may import its own modules and any package in a
lower layer (packages that share a layer do not import each other). A new package must be given a layer here, which is also where a reader finds
the architecture in one glance (README, "Design").

Between modules the imports form no cycle either, counting the ones inside functions. An
import goes inside a function only to defer a heavy library (``HEAVY``) that the module does
not load anyway (directly or through an npuq module it imports at module level), with a
one-line reason in a comment on the import or on the line above it (a run of imports shares
that comment); every other import sits at the top of its module.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "npuq"

# bottom to top; one package (or top-level module) per entry of a layer
LAYERS = (
    ("errors", "__init__", "partition"),  # the one error type users see, the version; balanced splits
    ("fsio", "records"),                 # atomic files and folders, safe readers; records as JSON
    ("device", "resources", "threads"),  # where work runs: device, memory/disk guards, thread plans
    ("models", "data"),                  # model sources, config, static decoder; corpora and windows
    ("runtime",),                        # KV-cache runner over any graph, workloads, generation
    ("quant",),                          # numeric formats, recipes, PT2E quantizer and observers
    ("calibrate",),                      # calibration engines, encoding transfer, encodings.json
    ("optimize",),                       # SeqMSE, GPTQ and their driver over a whole model
    ("quantize",),                       # the quantize stage: PT2E flow and the artifact it writes
    ("eval",),                           # perplexity and per-layer error over any logits callable
    ("lower",),                          # target, builders, ONNX writer, ORT sessions of an export
    ("runs",),                           # npuq run's options and typed results, as the report reads them
    ("report",),                         # report.json / report.html of a run
    ("pipeline",),                       # npuq run: cached stages, programs of any folder
    ("cli",),                            # the command line
    ("testing",),                        # helpers of the tests and benchmarks: nothing in npuq imports them
)
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def package_of(module: str) -> str:
    """npuq.quant.recipe → quant; npuq → __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "npuq"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "npuq":
            if node.module == "npuq":  # from npuq import X: X is a top-level module or package
                found += [(node.lineno, f"npuq.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def test_every_package_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert names - set(RANK) == set(), "give each new package a layer in LAYERS"


def test_imports_flow_down():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        here = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        source = package_of(here)
        for line, module in imports(path):
            target = package_of(module)
            if target == "__version__":
                target = "__init__"
            if target != source and RANK.get(target, len(LAYERS)) >= RANK[source]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line} ({source}) imports {module} ({target})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check itself can fail: a model module importing the CLI is reported."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from npuq.cli import main\n")
    (line, module), = imports(bad)
    assert (line, package_of(module)) == (2, "cli") and RANK["cli"] > RANK["models"]


# What may be imported inside a function, and what importing it loads: third-party modules whose
# import costs about 40 ms or more on its own (``python -X importtime -c "import X"``, measured
# on a 2-core CPU machine: torch 1.2 s, torchao 1.4 s on top of torch, transformers
# 0.7 s, onnx 0.7 s, datasets 0.7 s, matplotlib.pyplot 0.6 s, gguf 0.1-0.25 s, onnxruntime
# 0.1 s, numpy 60-80 ms, tqdm 50-110 ms, filelock 40-90 ms) or optional (lm_eval,
# onnxruntime_qnn). A key names a module and everything under it; the value is every heavy
# library importing it loads (``sys.modules`` after the import: torch loads numpy and tqdm).
# Anything else (the standard library, psutil 20 ms, threadpoolctl 20 ms, tokenizers 15 ms,
# every npuq module that loads none of these) is imported at module level.
HEAVY = {
    "torch": {"torch", "numpy", "tqdm"},
    "torchao": {"torchao", "torch", "numpy", "tqdm"},
    "transformers": {"transformers", "numpy", "tqdm", "filelock"},
    "onnx": {"onnx", "numpy"},
    "onnxruntime": {"onnxruntime", "numpy"},
    "onnxruntime_qnn": {"onnxruntime_qnn"},
    "lm_eval": {"lm_eval"},
    "datasets": {"datasets", "numpy", "tqdm", "filelock"},
    "matplotlib": {"matplotlib", "numpy"},
    "gguf": {"gguf", "numpy"},
    "numpy": {"numpy"},
    "tqdm": {"tqdm"},
    "filelock": {"filelock"},
    "safetensors.torch": {"torch", "numpy", "tqdm"},  # safetensors alone is light; its torch half is not
}

# Function-level imports that do not meet the rule yet, as "module -> imported module"; each
# entry must still be needed (test_allowed_exceptions_are_still_needed), so the list only shrinks.
ALLOWED: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the npuq module it resolves to, or the third-party module named
    internal: bool  # target is a module of the scanned package
    in_function: bool
    type_only: bool  # under ``if TYPE_CHECKING:``: never executed
    commented: bool  # a comment on the import or on the line above its run of imports


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def scan(root: Path) -> dict[str, list[Import]]:
    """Every import of every module under the package folder ``root``, by module name."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    return {name: _imports_of(name, path, modules) for name, path in paths.items()}


def _imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    lines = text.splitlines()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes: list[tuple[ast.stmt, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                nodes.append((child, in_function, type_only))
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            checking = type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if checking and not type_only and isinstance(child, ast.If):  # only its body is type-only
                for stmt in child.body:
                    visit_one(stmt, inside, True)
                for stmt in child.orelse:
                    visit_one(stmt, inside, type_only)
            else:
                visit(child, inside, type_only)

    def visit_one(stmt: ast.stmt, in_function: bool, type_only: bool) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            nodes.append((stmt, in_function, type_only))
        else:
            visit(stmt, in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)), type_only)

    visit(tree, False, False)
    starts = {}  # line → first line of the import statement covering it
    for node, _, _ in nodes:
        for n in range(node.lineno, node.end_lineno + 1):
            starts[n] = node.lineno

    def commented(node: ast.stmt) -> bool:
        if any(n in comments for n in range(node.lineno, node.end_lineno + 1)):
            return True
        above = node.lineno - 1
        while above in starts:  # a run of imports shares the comment above it
            if any(n in comments for n in range(starts[above], above + 1)):
                return True
            above = starts[above] - 1
        return above >= 1 and lines[above - 1].strip().startswith("#")

    found = []
    for node, in_function, type_only in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for full in dict.fromkeys(names):
            target = _resolve(full, modules)
            found.append(Import(node.lineno, target or full, target is not None, in_function, type_only,
                                commented(node)))
    return found


def find_cycles(root: Path) -> list[list[str]]:
    """The import cycles between the modules under ``root`` (imports inside functions and
    type-only ones count): each strongly connected set of two or more modules, sorted, or a
    module importing itself."""
    graph = {name: sorted({i.target for i in found if i.internal}) for name, found in scan(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def _heavy(target: str) -> set[str]:
    parts = target.split(".")
    return {lib for n in range(1, len(parts) + 1) for lib in HEAVY.get(".".join(parts[:n]), ())}


def heavy_loads(root: Path) -> dict[str, set[str]]:
    """Per module, the heavy libraries importing it loads: through its module-level imports, the
    npuq modules those reach, and the packages above each (their __init__ runs first)."""
    found = scan(root)
    loads = {}
    for name in found:
        seen, todo, heavy = set(), [name], set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            parent = m.rpartition(".")[0]
            if parent in found:
                todo.append(parent)
            for i in found[m]:
                if i.in_function or i.type_only:
                    continue
                if i.internal:
                    todo.append(i.target)
                else:
                    heavy |= _heavy(i.target)
        loads[name] = heavy
    return loads


def _deferrals(root: Path) -> list[tuple[str, Import, set[str]]]:
    """(module, import, heavy libraries it defers that the module does not load already) of
    every import inside a function."""
    loads = heavy_loads(root)
    return [(name, i, (loads[i.target] if i.internal else _heavy(i.target)) - loads[name])
            for name, found in scan(root).items() for i in found if i.in_function and not i.type_only]


def deferred_import_problems(root: Path, allowed: frozenset[str] = ALLOWED) -> list[str]:
    """Each import inside a function that defers nothing heavy, or gives no reason, unless
    ``allowed`` names it ("module -> imported module")."""
    problems = []
    for name, i, saved in _deferrals(root):
        if f"{name} -> {i.target}" in allowed:
            continue
        if not saved:
            problems.append(f"{name}:{i.line} imports {i.target} inside a function, which loads nothing "
                            f"heavy that {name} does not load already: import it at module level")
        elif not i.commented:
            problems.append(f"{name}:{i.line} defers {i.target} ({', '.join(sorted(saved))}) without a "
                            "one-line reason in a comment")
    return problems


def unneeded_allowances(root: Path, allowed: frozenset[str] = ALLOWED) -> list[str]:
    """The entries of ``allowed`` that no import under ``root`` needs any more."""
    needed = {f"{name} -> {i.target}" for name, i, saved in _deferrals(root) if not saved or not i.commented}
    return sorted(allowed - needed)


def test_no_import_cycles():
    cycles = find_cycles(SRC)
    assert not cycles, "modules that import each other (in a cycle):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_imports_inside_functions_defer_heavy_libraries():
    problems = deferred_import_problems(SRC)
    assert not problems, "\n".join(problems)


def test_allowed_exceptions_are_still_needed():
    """An entry of ALLOWED that the code no longer needs must go (the list only shrinks)."""
    assert unneeded_allowances(SRC) == [], "no longer needed: remove them from ALLOWED"


def test_nothing_in_npuq_imports_its_test_helpers():
    users = [f"{name}:{i.line} imports {i.target}" for name, found in scan(SRC).items()
             if not name.startswith("npuq.testing") for i in found
             if i.target == "npuq.testing" or i.target.startswith("npuq.testing.")]
    assert not users, "npuq.testing is for the tests and benchmarks only:\n" + "\n".join(users)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("a_text", [
    "from pkg.b import f\n",  # at module level
    "def g():\n    from pkg.b import f  # deferred\n",  # inside a function: still a cycle
    "def g():\n    from . import b\n",  # relative
])
def test_the_checker_sees_a_cycle(tmp_path, a_text):
    pkg = _tree(tmp_path, {"__init__.py": "", "a.py": a_text, "b.py": "import pkg.sub.c\nf = 1\n",
                           "sub/__init__.py": "", "sub/c.py": "from pkg.a import g\n", "d.py": "import pkg.a\n"})
    assert find_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_the_checker_passes_a_tree_without_cycles(tmp_path):
    pkg = _tree(tmp_path, {"__init__.py": "from pkg.a import g\n", "a.py": "from pkg.b import f\n",
                           "b.py": "import os\nf = 1\n"})  # a package importing its modules is no cycle
    assert find_cycles(pkg) == []


def test_the_checker_sees_needless_and_unexplained_deferred_imports(tmp_path):
    pkg = _tree(tmp_path, {
        "__init__.py": "",
        "light.py": "import json\n",
        "heavy.py": "import torch\n",
        "a.py": ("import numpy\n"
                 "def f():\n    import json\n"  # standard library: needless
                 "def g():\n    from pkg import light\n"  # a light npuq module: needless
                 "def h():\n    import numpy.linalg  # numpy is loaded already\n"
                 "def i():\n    import pkg.heavy  # torch: loaded on use\n"  # fine
                 "def j():\n    import torch\n"  # heavy, but no reason given
                 "def k():\n    # onnx and tqdm: loaded on use\n    import onnx\n    import tqdm\n"),  # fine
    })
    lines = [p.split(" ")[0] for p in deferred_import_problems(pkg)]
    assert lines == ["pkg.a:3", "pkg.a:5", "pkg.a:7", "pkg.a:11"]


def test_an_allowance_covers_one_import_and_must_stay_needed(tmp_path):
    pkg = _tree(tmp_path, {"__init__.py": "", "a.py": "def f():\n    import json\n"})
    assert deferred_import_problems(pkg, frozenset({"pkg.a -> json"})) == []
    assert unneeded_allowances(pkg, frozenset({"pkg.a -> json", "pkg.a -> os"})) == ["pkg.a -> os"]
