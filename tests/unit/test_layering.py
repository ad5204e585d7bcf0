"""The import rule, enforced on every module (in-function imports included):

    parity/   imports nothing of ours                    (the ground floor)
    rollout/  imports parity/ only                       (the vLLM side)
    trainer/  imports parity/ only                       (the Megatron side)
    rl/       imports all three; the only package that drives both sides

and no package has an import circle between its own modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("parity", "rollout", "trainer", "rl")
ALLOWED = {
    "parity": {"parity"},
    "rollout": {"rollout", "parity"},
    "trainer": {"trainer", "parity"},
    "rl": {"rl", "rollout", "trainer", "parity"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from parity import kernels` imports the module parity.kernels
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layering(module):
    path = MODULES[module]
    layer = module.split(".")[0]
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {layer}/ imports {target}"
        for line, target in _imports(path, module)
        if target.split(".")[0] in OURS and target.split(".")[0] not in ALLOWED[layer]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles_between_our_modules():
    graph = {
        m: {t for _, t in _imports(p, m) if t in MODULES and t != m} for m, p in MODULES.items()
    }
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import circle: " + " -> ".join(cycle))


def test_every_package_says_what_it_may_import():
    """Each package docstring ends with `Imports: a/, b/` (or `Imports: nothing of ours`),
    naming exactly what the rule above allows it."""
    for package, allowed in ALLOWED.items():
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
        line = next((x for x in doc.splitlines() if x.startswith("Imports:")), None)
        assert line is not None, f"{package}/__init__.py: docstring has no 'Imports:' line"
        named = {p for p in OURS if f"{p}/" in line}
        assert named == allowed - {package}, f"{package}/__init__.py: {line!r}"
