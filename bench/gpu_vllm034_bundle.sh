#!/bin/bash
# Builds, here (network, pip), a vLLM 0.34.0 GPU bundle for the lent GPU machine (Python 3.12, torch 2.11.0+cu130
# with its CUDA 13 nvidia-* libraries, no vLLM, no network) and cuts it into parts small enough to travel one per
# device call (a call carries at most 64 MiB together with the repository). Issue 49. The vLLM 0.26 bundle
# (../shared/gpu-vllm/build_bundle.sh) needs no torch; vLLM 0.34.0 pins torch 2.14.0, so this one carries:
#
#   torch 2.14.0   PyPI's manylinux_2_28 wheel, which is the CUDA 13.0 build (cuda-toolkit 13.0.3; the device's
#                  2.11.0 wants 13.0.2: the same libraries but cuBLAS 13.1.1.3 for 13.1.0.3, and no cuBLAS, cuDNN or
#                  cuSPARSELt function torch 2.14 or vLLM 0.34 calls is missing from the device's versions, checked
#                  with nm). Its fatbins cut to sm_90 (bench/gpu_prune_fatbin.py), headers (torch/include, only for
#                  C++ extensions and inductor's C++ paths; KEEP_TORCH_INCLUDE=1 keeps them) and protoc dropped.
#   triton 3.8.0   torch 2.14's pin (the device has 3.6.0). AMD backend, proton profiler, CUPTI, ptxas-blackwell,
#                  cuobjdump and nvdisasm dropped; its own ptxas (CUDA 12.9) kept.
#   NCCL 2.30.7    torch 2.14's pin: libtorch_cuda.so calls ncclCommGrow, ncclCommSuspend/Resume, ncclSignal,
#                  ncclWaitSignal, ncclPutSignal, ncclWinGetUserPtr, ... which the device's NCCL 2.28.9 lacks, so
#                  torch would not load against it. Cut to sm_90 (.nv_fatbin and __nv_relfatbin).
#   vllm 0.34.0    the CUDA wheel, slimmed as the 0.26 bundle is: no FlashAttention-2, no vllm-rs, no fmha_sm100;
#                  every CUDA library's fatbin cut to sm_90; FlashAttention-3 is sm_90 already.
#   deps           bench/gpu_vllm034_deps.txt (what the device lacks) and torchvision 0.29.0 (the device's 0.26 is
#                  built for torch 2.11; transformers imports torchvision when it is installed).
#   optional       WITH_CUTEDSL=1: nvidia-cutlass-dsl 4.8.0 (+ libs-base, libs-cu13) and quack-kernels 0.6.5, which
#                  vLLM 0.34 uses for some Hopper MoE/MLA kernels where present and falls back from where absent.
#
# Not carried: cuDNN 9.24 (torch 2.14's pin; the device has 9.19: torch refuses a cuDNN older than it was built
# with, on first use, unless PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1; vLLM's text models do not call cuDNN),
# cuSPARSELt 0.8.1 (the device's 0.8.0 exports every function torch calls), flashinfer (as for 0.26:
# VLLM_USE_FLASHINFER_SAMPLER=0).
#
# Output, in $OUTDIR (default .vllmgpu034/ at the checkout's root; added to .git/info/exclude like .vllmgpu/): vllm034.partNN (each
# <= $PART_MIB MiB; the components' .tar.xz streams back to back, cut), MANIFEST (part, bytes, sha256, in order),
# gpu_vllm034_unpack.py, SIZES (every step's size). Scratch in $WORK (default a temp dir): ~6 GB at most.
#
#   bash bench/gpu_vllm034_bundle.sh
#   env: OUTDIR, WORK, PART_MIB (default 55: the repository (~7 MiB without data/bench/verifier's 10 MiB of weights)
#        plus one part must stay under 64 MiB; with the weights in the tree use PART_MIB=46), XZ_LEVEL (default 9),
#        XZ_THREADS (default 1), KEEP_TORCH_INCLUDE=1, WITH_CUTEDSL=1, KEEP_WORK=1 (keep $WORK's unpacked trees)
#
# Measured 2026-12-07 (docs/development.md, "vLLM 0.34 on the device: the bundle"): .tar.xz torch 152.9 MiB, triton
# 91.0, NCCL 36.2, vllm 66.1, deps 35.4 = 381.7 MiB -> 7 parts of 55 MiB; 21 min here (19 of them xz on one thread).
#
# On the device, one call per part, back to back (the machine keeps /tmp only 30 s after a call):
#   call k = 1 .. N-1:  carry [".vllmgpu034/vllm034.partKK", ".vllmgpu034/MANIFEST", ".vllmgpu034/gpu_vllm034_unpack.py"]
#                       command: python3 .vllmgpu034/gpu_vllm034_unpack.py stash .vllmgpu034
#   call N (the last):  carry the last part, MANIFEST and gpu_vllm034_unpack.py, and begin the command with
#       python3 .vllmgpu034/gpu_vllm034_unpack.py unpack .vllmgpu034 && \
#       export PYTHONPATH=/tmp/site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
#              VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 && \
#       python3 -c 'import torch, vllm; print(torch.__version__, torch.cuda.get_device_name(), vllm.__version__)'
#   `unpack` checks every part's sha256 against MANIFEST, streams them through Python's lzma (no joined copy, no xz
#   binary) into /tmp/site, and links the device's nvidia/* folders (cu13, cudnn, cusparselt, nvshmem) beside the
#   carried NCCL so torch 2.14's RPATH ($ORIGIN/../../nvidia/<pkg>/lib) finds them. Then plan whole scripts per call.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null || pwd)
OUTDIR=${OUTDIR:-$REPO/.vllmgpu034}
WORK=${WORK:-$(mktemp -d)}
PART_MIB=${PART_MIB:-55}
XZ_LEVEL=${XZ_LEVEL:-9}
XZ_THREADS=${XZ_THREADS:-1}
PRUNE="python3 $HERE/gpu_prune_fatbin.py"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_25_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
mib() { du -sb --apparent-size "$@" | awk '{s += $1} END {printf "%.1f MiB", s / 2^20}'; }
mkdir -p "$WORK/dl" "$WORK/c" "$WORK/xz" "$OUTDIR"
# the parts must never travel as untracked files (each call would carry them all): ignore the folder, as the 0.26
# bundle's .vllmgpu/ is, in the checkout's own .git/info/exclude
OUTDIR=$(realpath "$OUTDIR")
if [[ $OUTDIR == "$REPO"/* ]] && git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 \
    && ! git -C "$REPO" check-ignore -q "$OUTDIR/MANIFEST"; then
  echo "/$(realpath --relative-to="$REPO" "$OUTDIR")/" >> "$(git -C "$REPO" rev-parse --git-common-dir)/info/exclude"
fi
SIZES=$OUTDIR/SIZES
: > "$SIZES"
note() { say "$*"; echo "$*" >> "$SIZES"; }
quiet() { grep -v -e "^WARNING: Location 'file:" -e "^WARNING: Running pip as the 'root'" || true; }
dl() { python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/dl" "$@" 2>&1 | quiet; }
whl() { ls "$WORK"/dl/"$1"-*.whl; }
fresh() { rm -rf "$WORK/c/$1"; mkdir -p "$WORK/c/$1/site"; echo "$WORK/c/$1/site"; }

# 1. the wheels (~1.3 GB)
dl torch==2.14.0 vllm==0.34.0 triton==3.8.0 nvidia-nccl-cu13==2.30.7 torchvision==0.29.0
for w in torch vllm triton nvidia_nccl_cu13 torchvision; do note "wheel $(basename "$(whl $w)"): $(mib "$(whl $w)")"; done

# 2. torch 2.14.0
S=$(fresh torch); unzip -q "$(whl torch)" -d "$S"
note "torch unpacked: $(mib "$S")"
rm -f "$S"/torch/bin/protoc*; rm -rf "$S"/torch/lib/libshm_windows "$S"/torch/share
[ "${KEEP_TORCH_INCLUDE:-0}" = 1 ] || rm -rf "$S"/torch/include
find "$S" -name '*.so*' -type f -print0 | xargs -0 $PRUNE | tee -a "$SIZES"
note "torch slimmed (files keep their size; the pruned images' bytes are zeros): $(mib "$S")"

# 3. triton 3.8.0
S=$(fresh triton); unzip -q "$(whl triton)" -d "$S"
note "triton unpacked: $(mib "$S")"
N=$S/triton/backends/nvidia
rm -rf "$S"/triton/backends/amd "$S"/triton/profiler "$S"/triton/_C/libproton.so "$N"/lib/cupti "$N"/lib/cupti-blackwell \
  "$N"/bin/ptxas-blackwell "$N"/bin/cuobjdump "$N"/bin/nvdisasm
note "triton slimmed: $(mib "$S")"

# 4. NCCL 2.30.7, where torch's RPATH looks ($ORIGIN/../../nvidia/nccl/lib)
S=$(fresh nccl); unzip -q "$(whl nvidia_nccl_cu13)" -d "$S"
note "nccl unpacked: $(mib "$S")"
rm -rf "$S"/nvidia/nccl/include
$PRUNE "$S"/nvidia/nccl/lib/*.so* | tee -a "$SIZES"

# 5. vLLM 0.34.0
S=$(fresh vllm); unzip -q "$(whl vllm)" -d "$S"
note "vllm unpacked: $(mib "$S")"
rm -f "$S"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$S"/vllm/vllm-rs
rm -rf "$S"/vllm/third_party/fmha_sm100
find "$S" -name '*.so' -type f -print0 | xargs -0 $PRUNE | tee -a "$SIZES"
note "vllm slimmed: $(mib "$S")"

# 6. the dependencies the device lacks, and torchvision 0.29.0
S=$(fresh deps)
rm -rf "$WORK/deps"; mkdir -p "$WORK/deps"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/deps" $(grep -v '^#' "$HERE/gpu_vllm034_deps.txt") 2>&1 | quiet
cp "$(whl torchvision)" "$WORK/deps/"
note "deps: $(ls "$WORK"/deps/*.whl | wc -l) wheels, $(mib "$WORK"/deps/*.whl)"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" "${PLAT[@]}" "$WORK"/deps/*.whl 2>&1 | quiet
rm -rf "$S/bin"
find "$S" -name '*.so*' -type f -print0 | xargs -0 $PRUNE >> "$SIZES"
note "deps installed: $(mib "$S")"

# 7. optional: CuTe DSL and quack
COMPONENTS=(torch triton nccl vllm deps)
if [ "${WITH_CUTEDSL:-0}" = 1 ]; then
  S=$(fresh cutedsl)
  dl nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-cu13==4.8.0 \
    quack-kernels==0.6.5 torch-c-dlpack-ext
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" "${PLAT[@]}" \
    "$(whl nvidia_cutlass_dsl)" "$(whl nvidia_cutlass_dsl_libs_base)" "$(whl nvidia_cutlass_dsl_libs_cu13)" \
    "$(whl quack_kernels)" "$(whl torch_c_dlpack_ext)" 2>&1 | quiet
  rm -rf "$S/bin"
  note "cutedsl installed: $(mib "$S")"
  COMPONENTS+=(cutedsl)
fi

# 8. one .tar.xz stream per component (in this order on the device), back to back, cut into parts
rm -f "$OUTDIR"/vllm034.part* "$OUTDIR"/MANIFEST
i=0
for c in "${COMPONENTS[@]}"; do
  i=$((i + 1))
  f=$WORK/xz/$(printf %02d $i)-$c.tar.xz
  tar -C "$WORK/c/$c" --owner=0 --group=0 -cf - site | nice -n 10 xz -"$XZ_LEVEL" -T"$XZ_THREADS" > "$f.tmp"
  mv "$f.tmp" "$f"
  note "$c.tar.xz: $(mib "$f") (from $(mib "$WORK/c/$c"))"
  [ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK/c/$c"
done
cat "$WORK"/xz/*.tar.xz | split -b "${PART_MIB}M" -d -a 2 - "$OUTDIR/vllm034.part"
{ echo "# part bytes sha256 (gpu_vllm034_unpack.py joins them in this order)"
  for p in "$OUTDIR"/vllm034.part*; do echo "$(basename "$p") $(stat -c %s "$p") $(sha256sum "$p" | cut -d' ' -f1)"; done
} > "$OUTDIR/MANIFEST"
cp "$HERE/gpu_vllm034_unpack.py" "$OUTDIR/"
n=$(ls "$OUTDIR"/vllm034.part* | wc -l)
note "total: $(mib "$WORK"/xz/*.tar.xz) in $n parts of <= $PART_MIB MiB"
tree=$(git -C "$REPO" ls-files -z 2>/dev/null | (cd "$REPO" && xargs -0 du -cb --apparent-size 2>/dev/null) | tail -1 | cut -f1)
note "this checkout's tracked files: $(awk -v b="${tree:-0}" 'BEGIN {printf "%.1f MiB", b / 2^20}') (+ one part must stay under 64 MiB)"
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK/xz" "$WORK/deps"
ls -l "$OUTDIR"
