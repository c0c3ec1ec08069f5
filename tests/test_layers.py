"""The package's layers point down only (docs/architecture.md), checked on the source's imports.

Layers, lowest first::

    0 base         unison.common.{config,dtypes,exceptions,runtime,files,ops,pool,compression,
                   agreement}, unison.run
    1 collectives  unison.collectives
    2 engine       unison.common.engine
    3 schedulers   every other part of unison.common (pipeline, and what comes next: grids,
                   sharding plans, elastic state, sharded tables, the performance model)
    4 backends     unison.tf_backend, unison.torch_backend, unison.keras, and unison/__init__.py

A module may import its own layer or lower ones, never a higher one; layers 0-3 never
import a framework (TensorFlow, PyTorch, JAX, Keras), not even inside a function; the two
backends never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "unison"
BASE = {"config", "dtypes", "exceptions", "runtime", "files", "ops", "pool", "compression", "agreement",
        "__init__"}
FRAMEWORKS = {"tensorflow", "torch", "jax", "jaxlib", "keras", "tf_keras"}
NAMES = ["base", "collectives", "engine", "schedulers", "backends"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if parts == ["unison"]:
        return 4
    top = parts[1]
    if top == "common":
        if len(parts) == 2 or parts[2] in BASE:
            return 0
        return 2 if parts[2] == "engine" else 3
    if top == "collectives":
        return 1
    if top == "run":
        return 0
    return 4


def resolve(node: ast.ImportFrom | ast.Import, here: str, is_package: bool) -> list[str]:
    """The unison modules (or packages) an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = here.split(".") if is_package else here.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        path = ROOT / Path(*candidate.split("."))
        out.append(candidate if path.with_suffix(".py").exists() or path.is_dir() else base)
    return out


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(node, here, path.name == "__init__.py"):
                    found.append((here, target, node.lineno))
    return found


def test_the_walker_sees_imports():
    pairs = imports()
    assert any(a == "unison.collectives.kernels" and b == "unison.collectives.ring" for a, b, _ in pairs)
    assert any(a == "unison.common.engine.frontend" and b == "unison.common.runtime" for a, b, _ in pairs)
    assert any(a.startswith("unison.torch_backend") and b == "torch" for a, b, _ in pairs)
    assert layer("unison.common.runtime") == 0 and layer("unison.common.engine.engine") == 2
    assert layer("unison.common.pipeline.driver") == 3 and layer("unison.tf_backend.strategy") == 4
    assert layer("unison.common.tensor_parallel.grid") == 3 and layer("unison.common.zero.plan") == 3


def test_layers_point_down_only():
    wrong = []
    for here, target, line in imports():
        if target.split(".")[0] != "unison":
            continue
        if layer(target) > layer(here):
            wrong.append(f"{here}:{line} ({NAMES[layer(here)]}) imports {target} ({NAMES[layer(target)]})")
    assert not wrong, "imports pointing up a layer:\n" + "\n".join(wrong)


def test_core_never_imports_a_framework():
    wrong = [f"{here}:{line} imports {target}" for here, target, line in imports()
             if layer(here) < 4 and target.split(".")[0] in FRAMEWORKS]
    assert not wrong, "framework imports below the backends:\n" + "\n".join(wrong)


@pytest.mark.parametrize("a,b", [("tf_backend", "torch_backend"), ("torch_backend", "tf_backend")])
def test_backends_do_not_import_each_other(a, b):
    wrong = [f"{here}:{line} imports {target}" for here, target, line in imports()
             if here.startswith(f"unison.{a}") and target.startswith(f"unison.{b}")]
    assert not wrong, "\n".join(wrong)
