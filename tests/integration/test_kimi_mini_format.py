"""Old kimi-mini directories (`KimiMiniForCausalLM`, written before kimi-mini became presets of
kimi-linear) still load on both engines, converted on load (parity/kimi_formats.py): fp32
logits bitwise equal to those of the converted kimi-linear twin directory, on the real Megatron
trainer and the real vLLM rollout, and `kimi-rl parity check` passes on the old directory.

Prompts run past index_topk (16) and the 64-key attention block, so the old indexer (on the
hidden state) really selects."""

from __future__ import annotations

import random

import pytest
import torch

from parity.model_spec import KimiSpec, load_spec
from rl.checker import CheckArgs, run_check
from rollout.engine import RolloutEngine
from tests.conftest import write_converted_twin, write_old_kimi_mini, write_prompt_file
from trainer.megatron.logprobs import forward_logits
from trainer.megatron.model import load_model

LENGTHS = (1, 17, 70, 130)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-mini-old")
    old = write_old_kimi_mini(root / "old")
    return str(old), str(write_converted_twin(old, root / "twin"))


def _seqs(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def test_old_directory_reads_as_its_twin(dirs):
    old, twin = dirs
    spec = load_spec(old)
    assert isinstance(spec, KimiSpec) and spec == load_spec(twin) and spec.index_query_source == "hidden"


def test_trainer_logits_equal_the_twins_bitwise(dirs, megatron):
    old, twin = dirs
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for r, s in enumerate(_seqs()):
        ids[r, : len(s)] = torch.tensor(s)
    logits = []
    for path in (old, twin):
        model = load_model(path, "fp32", parity=True).eval()
        with torch.no_grad():
            logits.append(forward_logits(model, ids))
    assert logits[0].dtype == torch.float32 and torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


def test_rollout_logprobs_equal_the_twins_bitwise(dirs):
    """vLLM's teacher-forced log-probs (a log-softmax of each position's logits), one engine at
    a time: two in-process engines would share vLLM's process-global parallel state."""
    got = []
    for path in dirs:
        engine = RolloutEngine(path, dtype="fp32", max_model_len=256, max_num_seqs=8, multiprocess=False)
        try:
            got.append(engine.prompt_logprobs(_seqs()[1:]))
        finally:
            engine.close()
    for a, b in zip(*got, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_parity_check_passes_on_the_old_directory(dirs, tmp_path):
    old, _ = dirs
    args = CheckArgs(
        model=old, dtype="fp32", prompts=write_prompt_file(tmp_path, LENGTHS), num_prompts=len(LENGTHS),
        max_tokens=8, batch_sizes=[1, 4], parity=True, seed=0, report=None, max_num_batched_tokens=64,
    )
    report = run_check(args).report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0 and report["max_abs_diff"] == 0.0
