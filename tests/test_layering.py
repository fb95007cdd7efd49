"""Imports flow one way: from the entry points down to data and models, never back up.

Every ``npuq`` import in ``src/npuq`` (at module level or inside a function) is checked
against the layer table below; a package may import its own modules and any package in a
lower layer (packages that share a layer do not import each other). A new package must be given a layer here, which is also where a reader finds
the architecture in one glance (README, "Design").
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "npuq"

# bottom to top; one package (or top-level module) per entry of a layer
LAYERS = (
    ("errors", "__init__"),              # the one error type users see, the version
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
