#!/usr/bin/env bash
# Patch a scratch copy of rollout/attention.py so the parity attention backend runs under
# vLLM's CUDA build 0.24.0 (docs/gpu.md, "vLLM on the GPU"). Run it only on a throw-away
# checkout (the GPU machine's copy): it edits the file in place. Two changes, both candidates
# for the backend's owners to fold in:
#   1. ctx_slots: the block-table gather (a CUDA tensor) is brought to the CPU, where the
#      positions and seq_lens live, before slots and the mask are formed.
#   2. vLLM 0.24 has no AttentionBackendEnum.register; it offers one CUSTOM slot, filled with
#      register_backend(AttentionBackendEnum.CUSTOM, path), and get_name() must return "CUSTOM".
set -eu
f=${1:-rollout/attention.py}
python3 - "$f" <<'EOF'
import sys
p = sys.argv[1]
s = open(p).read()
old1 = "torch.where(pos.unsqueeze(0) < seq_lens.unsqueeze(1), slots, 0)"
new1 = "torch.where((pos.unsqueeze(0) < seq_lens.unsqueeze(1)).to(slots.device), slots, 0)"
old2 = """    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(BACKEND_NAME, _BACKEND_PATH)"""
new2 = """    global BACKEND_NAME
    if not hasattr(AttentionBackendEnum, "register"):  # vLLM 0.24: the one CUSTOM slot
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(AttentionBackendEnum.CUSTOM, _BACKEND_PATH)
        BACKEND_NAME = "CUSTOM"
        return
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(BACKEND_NAME, _BACKEND_PATH)"""
old3 = "blocks = block_table[:, pos // bs].to(torch.int64)"
new3 = "blocks = block_table[:, pos // bs].to(device=\"cpu\", dtype=torch.int64)"
for old, new in ((old1, new1), (old2, new2), (old3, new3)):
    if new in s:
        continue
    if old not in s:
        sys.exit(f"{p}: patch target not found: {old[:60]!r}")
    s = s.replace(old, new)
open(p, "w").write(s)
print(f"patched {p}")
EOF
