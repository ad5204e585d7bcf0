"""The import rule, enforced on every module (in-function imports included):

    parity/   imports nothing of ours                    (the ground floor)
    rollout/  imports parity/ only                       (the vLLM side)
    trainer/  imports parity/ only                       (the trainer side)
    rl/       imports all three; the only package that drives both sides

inside trainer/, one room per backend:

    trainer/megatron/, trainer/deepspeed/   import trainer's shared modules, never each other
    trainer/*.py (shared)                   import no room (trainer.backend names them as
                                            strings, imported on first use)
    rl/                                     imports only the trainer interface: RL_TRAINER

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
ROOMS = ("trainer.megatron", "trainer.deepspeed")
# The trainer modules rl/ may import: the backend interface, the checkpoint format (resume
# checks in the driver) and the config sections. Never a room.
RL_TRAINER = ("trainer.backend", "trainer.checkpoint", "trainer.config")


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


def _room(name: str) -> str | None:
    return next((r for r in ROOMS if name == r or name.startswith(r + ".")), None)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("trainer")))
def test_a_room_never_imports_the_other_and_shared_trainer_code_no_room(module):
    own = _room(module)
    bad = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {module} imports {target}"
        for line, target in _imports(MODULES[module], module)
        if (room := _room(target)) is not None and room != own
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "rl"))
def test_rl_imports_only_the_trainer_interface(module):
    bad = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {module} imports {target} (rl/ may import "
        f"{', '.join(RL_TRAINER)} only)"
        for line, target in _imports(MODULES[module], module)
        if target.split(".")[0] == "trainer" and target != "trainer"
        and not any(target == m or target.startswith(m + ".") for m in RL_TRAINER)
    ]
    assert not bad, "\n".join(bad)


def test_the_trainer_interface_modules_exist_and_are_no_room():
    for name in RL_TRAINER:
        assert name in MODULES and _room(name) is None, name


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


def test_every_room_says_what_it_may_import():
    """Each room's docstring has an `Imports:` line naming parity/ and, after "never", the other
    room."""
    for room in ROOMS:
        path = ROOT / Path(*room.split(".")) / "__init__.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        line = next((x for x in doc.splitlines() if x.startswith("Imports:")), None)
        assert line is not None, f"{path.relative_to(ROOT)}: docstring has no 'Imports:' line"
        (other,) = (r for r in ROOMS if r != room)
        allowed, _, forbidden = line.partition("never")
        assert "parity/" in allowed and other.replace(".", "/") + "/" in forbidden, f"{path}: {line!r}"
