"""The shape fuzzer's draws (scripts/fuzz_parity.py), drawing only, no runs: the recorded
streams of docs/fuzz_isa_mix*.json still draw what they drew now that kimi-linear is an arch, and
every kimi-linear draw is a config the parity model accepts, with the indexer only on a query
latent, an even cache entry and prompt lengths at the top-k and 64-key block edges."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from parity.model_spec import KimiSpec
from rl.models import kimi_config
from scripts.fuzz_parity import ARCHS, DEFAULT_ARCHS, draw_trial, fix_kimi, shape_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "seed", "rows"), [("fuzz_isa_mix.json", 1, 200), ("fuzz_isa_mix_seed2.json", 2, 16)])
def test_recorded_stream_draws_what_it_drew(name: str, seed: int, rows: int):
    recorded = json.loads((ROOT / "docs" / name).read_text())
    assert recorded["seed"] == seed and recorded["archs"] == list(DEFAULT_ARCHS)
    assert "kimi-linear" in ARCHS and "kimi-linear" not in DEFAULT_ARCHS
    rng = random.Random(recorded["seed"])
    for row in recorded["trials"]:
        trial = draw_trial(rng, row["index"], list(DEFAULT_ARCHS))
        drawn = (trial.arch, trial.dtype, trial.shape, trial.batch_sizes, trial.prompt_lens,
                 trial.max_tokens, trial.max_num_batched_tokens, trial.kv_cache_dtype)
        # kimi-mini's shapes are nudged into kimi-linear's constraints since it writes that format
        shape = fix_kimi(dict(row["shape"])) if row["arch"] == "kimi-mini" else row["shape"]
        wanted = (row["arch"], row["dtype"], shape, row["batch_sizes"], row["prompt_lens"],
                  row["max_tokens"], row["max_num_batched_tokens"], "auto")
        assert drawn == wanted, row["index"]
    assert len(recorded["trials"]) == rows


def test_kimi_mini_draws_are_valid_configs():
    """Every kimi-mini draw (old keys) is a kimi-linear config the parity model accepts."""
    from rl.models import kimi_mini_overrides

    rng = random.Random(0)
    for index in range(300):
        trial = draw_trial(rng, index, ["kimi-mini"])
        config = kimi_config("kimi-mini", "tiny", 576)
        kimi_mini_overrides(config, trial.shape)
        lac = config["linear_attn_config"]
        config["num_hidden_layers"] = len(lac["kda_layers"]) + len(lac["full_attn_layers"])
        spec = KimiSpec.from_hf_config(config)
        assert spec.index_query_source == "latent" and spec.index_topk == trial.shape["index_topk"]
        assert spec.mla_cache_width % 4 == 0


def test_kimi_linear_draws_are_valid_configs():
    rng = random.Random(0)
    seen_topk, seen_kv, seen_rank = set(), set(), set()
    for index in range(400):
        trial = draw_trial(rng, index, ["kimi-linear"])
        config = {**kimi_config("kimi-linear", "tiny", 576), **trial.shape}
        lac = config["linear_attn_config"]
        config["num_hidden_layers"] = len(lac["kda_layers"]) + len(lac["full_attn_layers"])
        spec = KimiSpec.from_hf_config(config)  # raises on a shape the parity model refuses
        assert spec.has_indexer == bool(trial.shape.get("index_topk"))
        if spec.has_indexer:
            assert spec.q_lora_rank and spec.index_head_dim >= spec.qk_rope_head_dim
            topk = spec.index_topk
            assert trial.shape["index_n_heads"] in (1, 2, 4, 8)
            assert set(trial.prompt_lens) & {63, 64, 65, 130, topk - 1, topk, topk + 1}
        else:
            assert set(trial.prompt_lens) & {63, 64, 65, 130}
        assert spec.mla_cache_width % 2 == 0
        assert spec.hidden_size // spec.num_attention_heads % 2 == 0  # transformers' RoPE head_dim
        assert trial.max_num_batched_tokens in (32, 64)
        assert shape_text(trial).startswith(f"h{spec.hidden_size} ")
        seen_topk.add(spec.index_topk)
        seen_kv.add(trial.kv_cache_dtype)
        seen_rank.add(spec.q_lora_rank)
    assert seen_topk == {0, 4, 8, 16, 32}
    assert seen_kv == {"auto", "fp8"}
    assert seen_rank == {0, 32, 48, 64}
