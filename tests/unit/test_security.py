"""Nothing is unpickled from files: every load in the repository's Python code is
`torch.load(..., weights_only=True)`, safetensors, JSON or `yaml.safe_load` — never pickle,
`np.load(allow_pickle=True)` or a YAML loader that builds objects. Found by walking the AST of
every .py file (comments and strings do not count; aliases like `import pickle as p` do)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# module -> its functions that turn bytes into arbitrary objects
UNPICKLERS = {
    "pickle": {"load", "loads", "Unpickler"}, "_pickle": {"load", "loads", "Unpickler"},
    "cloudpickle": {"load", "loads"}, "dill": {"load", "loads"}, "joblib": {"load"},
    "marshal": {"load", "loads"}, "shelve": {"open"}, "jsonpickle": {"decode"},
    "yaml": {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all", "full_load_all"},
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _modules(tree: ast.AST) -> dict[str, str]:
    """Local name -> module, for `import x`, `import x as y` and `from x import f` (as "x.f")."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def unsafe_loads(source: str, filename: str = "<string>") -> list[str]:
    """`file:line: call` for each call that may unpickle."""
    tree = ast.parse(source, filename)
    names = _modules(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            qual = f"{names.get(func.value.id, func.value.id)}.{func.attr}"
        elif isinstance(func, ast.Name) and func.id in names:
            qual = names[func.id]
        else:
            continue
        module, _, attr = qual.rpartition(".")
        bad = False
        if module == "torch" and attr == "load":
            flag = _kw(node, "weights_only")
            bad = not (isinstance(flag, ast.Constant) and flag.value is True)
        elif module in ("numpy", "np") and attr == "load":
            flag = _kw(node, "allow_pickle")
            bad = not (flag is None or (isinstance(flag, ast.Constant) and flag.value is False))
        elif module == "yaml" and attr in ("load", "load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            name = loader.attr if isinstance(loader, ast.Attribute) else getattr(loader, "id", None)
            bad = name not in SAFE_YAML_LOADERS
        elif attr in UNPICKLERS.get(module.split(".")[0], ()):
            bad = True
        if bad:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_unsafe_loads_in_the_repository():
    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") or part in ("build", "runs")
                                                      for part in p.relative_to(ROOT).parts)]
    assert len(files) > 50  # the walk found the code
    found = [hit for p in files for hit in unsafe_loads(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not found, "loads that may unpickle:\n" + "\n".join(found)


@pytest.mark.parametrize(("code", "unsafe"), [
    ("import torch\ntorch.load(p)", True),
    ("import torch\ntorch.load(p, weights_only=False)", True),
    ("import torch\ntorch.load(p, map_location='cpu', weights_only=True)", False),
    ("from torch import load\nload(p)", True),
    ("import pickle as pk\npk.loads(b)", True),
    ("from pickle import Unpickler\nUnpickler(f).load()", True),
    ("import numpy as np\nnp.load(p, allow_pickle=True)", True),
    ("import numpy as np\nnp.load(p)", False),
    ("import yaml\nyaml.load(t, Loader=yaml.FullLoader)", True),
    ("import yaml\nyaml.load(t, Loader=yaml.SafeLoader)", False),
    ("import yaml\nyaml.safe_load(t)", False),
    ("import cloudpickle\ncloudpickle.load(f)", True),
    ("import json\njson.load(f)", False),
])
def test_the_detector_flags_unsafe_loads(code, unsafe):
    assert bool(unsafe_loads(code)) is unsafe
