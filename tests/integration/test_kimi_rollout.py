"""The Kimi rollout model (the tiny kimi-mini preset, which writes kimi-linear) on a real vLLM engine (no mocks), fp32 and bf16: decode equals
teacher-forced prefill, log-probs are invariant to batching and chunked prefill, equal a direct
whole-sequence loop over the `parity.kimi` functions (the trainer's math), LoRA changes and
clear_adapter restores them bitwise, and the routing trace covers every processed position.

One in-process engine per dtype (a module-scoped fixture); the chunked-prefill test starts a
second, small-budget multiprocess engine for its dtype. Prompts run longer than index_topk (16) and KV_BLOCK
(64), so the indexer really selects and the MLA context spans several blocks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from parity import kernels, kimi
from parity.model_spec import KimiSpec
from parity.wire import pack_tensors
from rollout.engine import RolloutEngine

VOCAB_LOW, VOCAB_HIGH = 3, 500
PROMPT_LENS = (1, 5, 17, 40, 70, 130)
MAX_TOKENS = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def reference(
    model_dir: str, dtype: torch.dtype, seq: list[int], pairs: dict | None = None, scaling: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(log p(seq[i] | seq[:i]) [len-1], {layer trace name: tensor}) from one whole-sequence
    pass over the parity.kimi functions, from the HF checkpoint alone (no vLLM, no rollout
    code); what the trainer computes."""
    s = KimiSpec.from_dir(model_dir)
    w = {k: v.to(dtype) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    pairs = pairs or {}
    parts = {path: p for path, (_, p) in kimi.lora_linears(s).items()}

    def lin(path: str, weight: torch.Tensor):
        own = parts.get(path, ((path, weight.shape[0]),))
        return lambda x: kimi.adapted_linear(x, weight, own, pairs, scaling)

    def hf(path: str):
        return lin(path, w[path + ".weight"])

    def ffn(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
        gate_up = torch.cat([w[f"{prefix}.{gate}.weight"], w[f"{prefix}.{up}.weight"]], 0)
        return SimpleNamespace(gate_up_proj=lin(prefix + ".gate_up_proj", gate_up), down_proj=hf(f"{prefix}.{down}"))

    ids = torch.tensor(seq)
    n = len(seq)
    pos = torch.arange(n)
    trace = {}
    x = kernels.embedding(ids, w["model.embed_tokens.weight"])
    for i, kind in enumerate(s.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn"
        h = kernels.rms_norm(x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
        if kind == "kda":
            m = SimpleNamespace(
                **{name: hf(f"{a}.{name}") for name in (
                    "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                    "o_proj")},
                conv1d=SimpleNamespace(weight=torch.cat([w[f"{a}.{c}_conv1d.weight"].flatten(1) for c in "qkv"])),
                dt_bias=w[a + ".dt_bias"],
                A_log=w[a + ".A_log"], o_norm=SimpleNamespace(weight=w[a + ".o_norm.weight"]),
            )
            d = s.kda_head_dim
            out, _, _ = kimi.kda_mixer(
                m, s, h, [n], torch.zeros(1, s.kda_conv_size - 1, s.kda_conv_channels),
                torch.zeros(1, s.kda_num_heads, d, d),
            )
        else:
            ix = a + ".indexer"
            m = SimpleNamespace(
                q_a_proj=hf(a + ".q_a_proj"), q_a_layernorm=SimpleNamespace(weight=w[a + ".q_a_layernorm.weight"]),
                q_b_proj=hf(a + ".q_b_proj"), kv_a_proj_with_mqa=hf(a + ".kv_a_proj_with_mqa"),
                kv_a_layernorm=SimpleNamespace(weight=w[a + ".kv_a_layernorm.weight"]),
                kv_b_proj=hf(a + ".kv_b_proj"), o_proj=hf(a + ".o_proj"),
                indexer=SimpleNamespace(
                    wq_b=hf(ix + ".wq_b"), wk=hf(ix + ".wk"), weights_proj=hf(ix + ".weights_proj"),
                    k_norm=SimpleNamespace(weight=w[ix + ".k_norm.weight"], bias=w[ix + ".k_norm.bias"]),
                ),
            )
            q, entry, iq, iw = kimi.mla_entries(m, s, h, pos)
            ctx = entry.unsqueeze(0)
            q_seq = torch.zeros(n, dtype=torch.int64)
            selected, count = kimi.indexer_topk(s, iq, iw, ctx[..., -s.index_head_dim :], q_seq, pos)
            out = kimi.mla_attend(m, s, q, ctx, q_seq, selected, count)
            trace[f"layers.{i}.self_attn.selected"] = selected
            trace[f"layers.{i}.self_attn.count"] = count
        x = x + out
        h = kernels.rms_norm(x, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        b = p + "block_sparse_moe."
        mlp = SimpleNamespace(
            gate=SimpleNamespace(weight=w[b + "gate.weight"], e_score_correction_bias=w[b + "gate.e_score_correction_bias"]),
            experts=[ffn(f"{b}experts.{e}", "w1", "w3", "w2") for e in range(s.n_routed_experts)],
            shared_experts=ffn(b + "shared_experts"),
        )
        out, experts = kimi.moe(mlp, s, h)
        trace[f"layers.{i}.mlp.experts"] = experts
        x = x + out
    x = kernels.rms_norm(x, w["model.norm.weight"], s.rms_norm_eps)
    logits = kernels.linear(x, w["model.embed_tokens.weight"])
    return kernels.token_logprobs(logits[:-1], ids[1:]), trace


def random_adapter(model_dir: str, dtype: torch.dtype, rank: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    """A peft-named adapter on every LoRA linear, B nonzero (peft would start B at zero)."""
    s = KimiSpec.from_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for fan_in, parts in kimi.lora_linears(s).values():
        for path, fan_out in parts:
            out[kimi.peft_name(path, "A")] = (torch.randn(rank, fan_in, generator=g) * 0.1).to(dtype)
            out[kimi.peft_name(path, "B")] = (torch.randn(fan_out, rank, generator=g) * 0.1).to(dtype)
    return out


@pytest.fixture(scope="module", params=list(DTYPES))
def case(request, model_factory):
    dtype = request.param
    model_dir = model_factory("kimi-mini", dtype)
    engine = RolloutEngine(model_dir, dtype=dtype, max_model_len=512, max_num_seqs=16, multiprocess=False)
    try:
        rng = random.Random(0)
        prompts = [_ids(rng, n) for n in PROMPT_LENS]
        engine.trace(True)
        completions = engine.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
        trace = engine.take_trace()
        engine.trace(False)
        yield {
            "dtype": dtype, "torch_dtype": DTYPES[dtype], "dir": model_dir, "engine": engine,
            "prompts": prompts, "completions": completions, "trace": trace,
            "full": [c.prompt_ids + c.token_ids for c in completions],
        }
    finally:
        engine.close()


def test_generate(case):
    for c in case["completions"]:
        assert len(c.token_ids) == MAX_TOKENS
        assert c.rollout_logprobs.dtype == torch.float32 and c.rollout_logprobs.shape == (MAX_TOKENS,)
        assert torch.isfinite(c.rollout_logprobs).all() and (c.rollout_logprobs <= 0).all()


def test_decode_equals_teacher_forced_prefill(case):
    teacher = case["engine"].prompt_logprobs(case["full"])
    for c, t in zip(case["completions"], teacher, strict=True):
        assert torch.equal(c.rollout_logprobs, t[len(c.prompt_ids) - 1 :])


def test_equals_direct_kimi_forward(case):
    got = case["engine"].prompt_logprobs(case["full"][-2:])
    for seq, g in zip(case["full"][-2:], got, strict=True):
        want, _ = reference(case["dir"], case["torch_dtype"], seq)
        assert torch.equal(g, want)


def test_batch_1_vs_16(case):
    rng = random.Random(7)
    seqs = [_ids(rng, rng.randrange(2, 120)) for _ in range(16)]
    batched = case["engine"].prompt_logprobs(seqs)
    for seq, b in zip(seqs, batched, strict=True):
        (alone,) = case["engine"].prompt_logprobs([seq])
        assert torch.equal(alone, b)


def test_chunked_prefill_equals_unchunked(case):
    """A second engine with a 64-token step budget, in its own processes: two in-process
    engines share vLLM's process-global parallel state, which closing one tears down. So this
    also covers the multiprocess engine (config and model registered in the EngineCore)."""
    rng = random.Random(3)
    seqs = [_ids(rng, n) for n in (100, 180, 300)]
    whole = case["engine"].prompt_logprobs(seqs)
    small = RolloutEngine(
        case["dir"], dtype=case["dtype"], max_model_len=512, max_num_seqs=16,
        max_num_batched_tokens=64, multiprocess=True,
    )
    try:
        chunked = small.prompt_logprobs(seqs)
        done = small.generate(seqs[:2], max_tokens=4, ignore_eos=True)
    finally:
        small.close()
    for w, c in zip(whole, chunked, strict=True):
        assert torch.equal(w, c)
    teacher = case["engine"].prompt_logprobs([d.prompt_ids + d.token_ids for d in done])
    for d, t in zip(done, teacher, strict=True):
        assert torch.equal(d.rollout_logprobs, t[len(d.prompt_ids) - 1 :])


def test_lora_changes_and_clear_restores(case):
    engine, seqs = case["engine"], case["full"][-2:]
    base = engine.prompt_logprobs(seqs)
    adapter = random_adapter(case["dir"], case["torch_dtype"])
    scaling = 2.0
    engine.set_adapter(adapter, scaling)
    try:
        assert engine.adapter_checksums().keys() == adapter.keys()
        adapted = engine.prompt_logprobs(seqs)
        assert not any(torch.equal(a, b) for a, b in zip(adapted, base, strict=True))
        s = KimiSpec.from_dir(case["dir"])
        pairs = {
            path: (adapter[kimi.peft_name(path, "A")], adapter[kimi.peft_name(path, "B")])
            for _, parts in kimi.lora_linears(s).values() for path, _ in parts
        }
        want, _ = reference(case["dir"], case["torch_dtype"], seqs[-1], pairs, scaling)
        assert torch.equal(adapted[-1], want)
        # The packed form of the same adapter computes the same, twice (the re-sync is a copy).
        flat, index = pack_tensors(adapter)
        engine.set_adapter_packed(flat, index, scaling)
        engine.set_adapter_packed(flat, index, scaling)
        assert all(torch.equal(a, b) for a, b in zip(engine.prompt_logprobs(seqs), adapted, strict=True))
    finally:
        engine.clear_adapter()
    assert engine.adapter_checksums() == {}
    assert all(torch.equal(a, b) for a, b in zip(engine.prompt_logprobs(seqs), base, strict=True))


def test_invalid_adapter_is_refused(case):
    adapter = random_adapter(case["dir"], case["torch_dtype"])
    name = next(iter(adapter))
    with pytest.raises(ValueError):
        case["engine"].set_adapter({**adapter, name: adapter[name].float().double()}, 1.0)
    with pytest.raises(ValueError):
        case["engine"].set_adapter({k: v for k, v in adapter.items() if k != name}, 1.0)
    with pytest.raises(ValueError):
        case["engine"].set_adapter({name.replace("layers.0", "layers.99"): adapter[name]}, 1.0)


def test_trace_covers_processed_positions(case):
    trace, s = case["trace"], KimiSpec.from_dir(case["dir"])
    assert len(trace) == len(case["completions"])
    for c, rec in zip(case["completions"], trace, strict=True):
        processed = len(c.prompt_ids) + len(c.token_ids) - 1  # the last sampled token is not fed
        for i, kind in enumerate(s.layer_types):
            assert rec[f"layers.{i}.mlp.experts"].shape == (processed, s.num_experts_per_tok)
            if kind == "mla":
                assert rec[f"layers.{i}.self_attn.selected"].shape == (processed, s.index_topk)
    # Equal to the whole-sequence pass (the trainer's trace) on the rollout's positions.
    c, rec = case["completions"][-1], trace[-1]
    _, want = reference(case["dir"], case["torch_dtype"], c.prompt_ids + c.token_ids)
    for name, got in rec.items():
        assert torch.equal(got, want[name][: got.shape[0]].to(torch.int64)), name


def test_weights_round_trip(case):
    engine = case["engine"]
    checkpoint = load_file(f"{case['dir']}/model.safetensors")
    from parity.compare import tensor_checksum

    held = engine.weight_checksums()
    assert held == {k: tensor_checksum(v) for k, v in checkpoint.items()}
    params = engine.param_checksums()
    assert "model.layers.0.block_sparse_moe.experts.0.gate_up_proj.weight" in params
    assert "model.layers.0.block_sparse_moe.shared_experts.gate_up_proj.weight" in params
    assert not any(k.endswith((".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")) for k in params)
    # Full-weight sync by rollout names (what the trainer sends), then back.
    name = "model.layers.3.block_sparse_moe.experts.1.gate_up_proj.weight"
    fused = torch.cat([checkpoint[name.replace("gate_up_proj", "w1")], checkpoint[name.replace("gate_up_proj", "w3")]])
    engine.update_params_packed(*pack_tensors({name: fused * 2}))
    assert engine.param_checksums()[name] == tensor_checksum(fused * 2)
    engine.update_params_packed(*pack_tensors({name: fused}))
    # HF names through vLLM's in-place reload.
    hf = "model.layers.0.self_attn.q_proj.weight"
    engine.update_weights({hf: checkpoint[hf] * 2})
    assert engine.weight_checksums()[hf] == tensor_checksum(checkpoint[hf] * 2)
    engine.update_weights({hf: checkpoint[hf]})
    assert engine.weight_checksums() == held
