"""trainer.backend, the one interface between rl/ and a trainer backend: it names every backend
the config allows, each name resolves to that room's Backend, and importing the interface
imports no room (nor megatron-core, nor DeepSpeed)."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from trainer.backend import BACKENDS, Backend, get_backend
from trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_names_exactly_the_configs_backends():
    hints = typing.get_type_hints(TrainerConfig)
    assert set(BACKENDS) == set(typing.get_args(hints["backend"]))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_name_resolves_to_its_rooms_backend(name):
    backend = get_backend(name)
    assert isinstance(backend, Backend) and backend.name == name
    assert type(backend).__module__ == f"trainer.{name}.backend"


def test_an_unknown_backend_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"trainer.backend must be one of megatron, deepspeed, got 'nemo'"):
        get_backend("nemo")


def test_importing_the_interface_imports_no_room():
    code = ("import sys, trainer.backend, trainer.checkpoint, trainer.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed') "
            "or m.startswith(('trainer.megatron', 'trainer.deepspeed'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
