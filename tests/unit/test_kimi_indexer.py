"""kimi-linear's K3 additions. The sparse indexer (DeepSeek-V3.2's, on the MLA layers): `model
init --set` writes its config fields and transformers' DeepseekV32Indexer tensor names; KimiSpec
refuses an incomplete config with one line naming the field; the scores and the top-k selection
of `parity.kimi` equal transformers' own DeepseekV32Indexer with the same weights copied in.
The MLA output gate (mla_use_output_gate): its tensor and its formula; attn_res_block_size is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity import kimi
from parity.model_spec import KimiSpec, load_spec
from rl.cli import main as cli_main

INDEXER_SET = ["--set", "q_lora_rank=48", "--set", "index_n_heads=4", "--set", "index_head_dim=32",
               "--set", "index_topk=16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kl-idx") / "model"
    argv = ["model", "init", "--arch", "kimi-linear", "--preset", "tiny", "--seed", "0", *INDEXER_SET, str(out)]
    assert cli_main(argv) == 0
    return out


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_init_writes_the_fields_and_the_deepseek_v32_names(model_dir):
    c = _config(model_dir)
    assert (c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (48, 4, 32, 16)
    w = load_file(str(model_dir / "model.safetensors"))
    a = "model.layers.3.self_attn."
    shapes = {k[len(a):]: tuple(v.shape) for k, v in w.items() if k.startswith(a)}
    assert shapes["indexer.wq_b.weight"] == (4 * 32, 48) and shapes["indexer.wk.weight"] == (32, 128)
    assert shapes["indexer.k_norm.weight"] == (32,) and shapes["indexer.k_norm.bias"] == (32,)
    assert shapes["indexer.weights_proj.weight"] == (4, 128)
    assert shapes["q_a_proj.weight"] == (48, 128) and shapes["q_a_layernorm.weight"] == (48,)
    assert shapes["q_b_proj.weight"] == (4 * 48, 48) and "q_proj.weight" not in shapes
    assert not any(".indexer." in k for k in w if not k.startswith(a))  # MLA layers only
    spec = load_spec(model_dir)
    assert spec.has_indexer and spec.index_query_source == "latent" and spec.q_lora_rank == 48
    assert spec.mla_cache_width == 64 + 16 + 32 and spec.mla_cache_parts == (80, 32)
    # LoRA reaches the low-rank query, never the indexer (top-k passes no gradient to it).
    paths = {p for _, parts in kimi.lora_linears(spec).values() for p, _ in parts}
    assert a + "q_a_proj" in paths and a + "q_b_proj" in paths and not any(".indexer." in p for p in paths)


@pytest.mark.parametrize("drop,value,words", [
    ("q_lora_rank", None, "q_lora_rank must be set when index_topk"),
    ("index_head_dim", None, "index_head_dim must be >= 1"),
    ("index_head_dim", 8, "index_head_dim must be >= qk_rope_head_dim"),
])
def test_spec_refuses_an_incomplete_indexer(model_dir, drop, value, words):
    with pytest.raises(ValueError, match=words):
        KimiSpec.from_hf_config({**_config(model_dir), drop: value})


def test_cli_refuses_the_indexer_without_q_lora_rank(tmp_path, capsys):
    bad = tmp_path / "bad"
    argv = ["model", "init", "--arch", "kimi-linear", "--preset", "tiny", "--seed", "0", *INDEXER_SET[2:], str(bad)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "q_lora_rank" in err and len(err.strip().splitlines()) == 1 and not bad.exists()


class _Indexer(torch.nn.Module):
    """The module view parity.kimi reads (HF names), holding one checkpoint's indexer weights."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        for name in ("wq_b", "wk", "weights_proj"):
            setattr(self, name, lambda x, weight=w[f"{prefix}{name}.weight"]: kimi.kernels.linear(x, weight))
        self.k_norm = torch.nn.Module()
        self.k_norm.weight, self.k_norm.bias = w[prefix + "k_norm.weight"], w[prefix + "k_norm.bias"]


def test_scores_and_selection_match_transformers_deepseek_v32_indexer(model_dir):
    """Random hidden states and query latents, two sequences of 150 tokens, fp32: our top-16
    equals transformers' DeepseekV32Indexer.forward (as sets) at every position where it drops
    keys, and our scores (parity.kimi.indexer_scores) equal the reference formula, computed with
    the reference module's own layers, within fp32 rounding."""
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Indexer,
        DeepseekV32RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    c, spec = _config(model_dir), load_spec(model_dir)
    w = load_file(str(model_dir / "model.safetensors"))
    prefix = "model.layers.3.self_attn.indexer."
    ref_config = DeepseekV32Config(
        hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"], index_topk=c["index_topk"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        max_position_embeddings=c["model_max_length"],
    )
    ref = DeepseekV32Indexer(ref_config, layer_idx=0)
    ref.load_state_dict({k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)})
    assert isinstance(ref.k_norm, torch.nn.LayerNorm) and ref.k_norm.bias is not None
    rope = DeepseekV32RotaryEmbedding(ref_config)

    g = torch.Generator().manual_seed(0)
    b, length, hi, di, dr, topk = 2, 150, 4, 32, c["qk_rope_head_dim"], 16
    h = torch.randn(b, length, c["hidden_size"], generator=g)
    q_latent = torch.randn(b, length, c["q_lora_rank"], generator=g)
    position_ids = torch.arange(length).unsqueeze(0).expand(b, -1)
    cos_sin = rope(h, position_ids)
    causal = torch.ones(length, length, dtype=torch.bool).tril().unsqueeze(0).expand(b, -1, -1)
    with torch.no_grad():
        ref_top = ref(h, q_latent, cos_sin, causal, position_ids).long().reshape(b * length, topk)

    positions = torch.arange(length).repeat(b)
    q_seq = torch.arange(b).repeat_interleave(length)
    index_q, index_k, index_w = kimi._v32_index_inputs(
        _Indexer(w, prefix), spec, h.reshape(b * length, -1), q_latent.reshape(b * length, -1), positions)
    index_k = index_k.view(b, length, di)
    selected, count = kimi.indexer_topk(spec, index_q, index_w, index_k, q_seq, positions)

    assert torch.equal(count, torch.clamp(positions + 1, max=topk))
    drops = positions >= topk  # rows where the indexer really drops keys
    assert int(drops.sum()) == b * (length - topk)
    for t in (~drops).nonzero().squeeze(1).tolist():  # fewer keys than topk: every one of them
        assert torch.equal(selected[t, : count[t]], torch.arange(int(count[t])))
    # Where keys are dropped: the same top-k as the reference, except that where the k-th best
    # score is tied (the ReLU makes exact zeros), ours keeps the lowest tied positions and the
    # reference's torch.topk any of them.
    ours = kimi.indexer_scores(spec, index_q, index_w, index_k, q_seq, positions)[:, :length]
    tied_rows = 0
    for t in drops.nonzero().squeeze(1).tolist():
        kth = torch.sort(ours[t], descending=True).values[topk - 1]
        above, tied = (ours[t] > kth).nonzero().squeeze(1), (ours[t] == kth).nonzero().squeeze(1)
        expected = torch.sort(torch.cat([above, tied[: topk - above.numel()]])).values
        assert torch.equal(selected[t], expected)
        ref_set = set(ref_top[t].tolist())
        assert set(above.tolist()) <= ref_set and ref_set <= set(above.tolist()) | set(tied.tolist())
        tied_rows += tied.numel() > topk - above.numel()
        if tied.numel() == topk - above.numel():
            assert torch.equal(selected[t], torch.sort(ref_top[t]).values)
    assert 0 < tied_rows < int(drops.sum()) // 4

    # Scores: the reference formula on the reference module's own layers.
    with torch.no_grad():
        rq = ref.wq_b(q_latent).view(b, length, hi, di)
        rk = ref.k_norm(ref.wk(h)).unsqueeze(2)
        q_rot, k_rot = apply_rotary_pos_emb(rq[..., :dr], rk[..., :dr], *cos_sin, unsqueeze_dim=2)
        rq = torch.cat([q_rot, rq[..., dr:]], -1)  # [B, S, H, D]
        rk = torch.cat([k_rot, rk[..., dr:]], -1).squeeze(2)  # [B, S, D]
        relu = torch.relu(torch.matmul(rq, rk.transpose(-1, -2).unsqueeze(1)) * di**-0.5)  # [B, S, H, S]
        weights = ref.weights_proj(h) * hi**-0.5
        ref_scores = torch.matmul(weights.unsqueeze(-2), relu).squeeze(-2).masked_fill(~causal, -torch.inf)
    ref_scores = ref_scores.reshape(b * length, length)
    assert torch.equal(ours.isinf(), ref_scores.isinf())
    finite = ~ref_scores.isinf()
    assert (ours[finite] - ref_scores[finite]).abs().max() < 1e-5 * ref_scores[finite].abs().max()


def test_transformers_loads_a_low_rank_query_without_missing_or_unexpected_keys(tmp_path):
    """q_lora_rank alone (no indexer): q_a_proj / q_a_layernorm / q_b_proj are the names
    transformers' KimiLinearForCausalLM holds."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import use_transformers_kimi_linear_config

    out = tmp_path / "lowrank"
    argv = ["model", "init", "--arch", "kimi-linear", "--preset", "tiny", "--seed", "0",
            "--set", "q_lora_rank=48", str(out)]
    assert cli_main(argv) == 0
    use_transformers_kimi_linear_config()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert "model.layers.3.self_attn.q_b_proj.weight" in load_file(str(out / "model.safetensors"))


def test_output_gate_tensor_and_formula(tmp_path):
    """`--set mla_use_output_gate=true` adds self_attn.g_proj [Hm * dv, hidden] to the MLA
    layer; the output is o_proj(attn * sigmoid(g_proj(h))) (Kimi K3's gate, as vLLM's kimi_k3
    MLA applies it)."""
    out = tmp_path / "gated"
    argv = ["model", "init", "--arch", "kimi-linear", "--preset", "tiny", "--seed", "0",
            "--set", "mla_use_output_gate=true", str(out)]
    assert cli_main(argv) == 0
    spec = load_spec(out)
    assert spec.mla_output_gate and not spec.has_indexer
    w = load_file(str(out / "model.safetensors"))
    assert tuple(w["model.layers.3.self_attn.g_proj.weight"].shape) == (4 * 32, 128)

    g = torch.Generator().manual_seed(0)
    a = "model.layers.3.self_attn."
    m = torch.nn.Module()
    for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj"):
        setattr(m, name, lambda x, weight=w[a + name + ".weight"]: kimi.kernels.linear(x, weight))
    m.kv_a_layernorm = torch.nn.Module()
    m.kv_a_layernorm.weight = w[a + "kv_a_layernorm.weight"]
    m.o_proj = lambda x: x  # to see the gated attention output itself
    n = 20
    h, positions = torch.randn(n, 128, generator=g), torch.arange(n)
    q, entry, _, _ = kimi.mla_entries(m, spec, h, positions)
    zeros = torch.zeros(n, dtype=torch.int64)
    plain = kimi.mla_attend_full(m, spec, q, entry[None], zeros, positions)
    gate = kimi.mla_gate(m, spec, h)
    gated = kimi.mla_attend_full(m, spec, q, entry[None], zeros, positions, gate)
    want = plain * torch.sigmoid(h @ w[a + "g_proj.weight"].T)
    assert (gated - want).abs().max() < 1e-6 and (gated - plain).abs().max() > 1e-3


def test_spec_refuses_attention_residuals(model_dir):
    with pytest.raises(ValueError, match="attn_res_block_size: 2 is not supported"):
        KimiSpec.from_hf_config({**_config(model_dir), "attn_res_block_size": 2})
