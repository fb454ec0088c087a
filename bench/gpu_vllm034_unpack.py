"""Device side of the vLLM 0.34 bundle (bench/gpu_vllm034_bundle.sh): gather its parts, check, unpack to /tmp/site.

    python3 .vllmgpu034/gpu_vllm034_unpack.py stash .vllmgpu034      # every call: copy the parts it carried to /tmp/v034
    python3 .vllmgpu034/gpu_vllm034_unpack.py unpack .vllmgpu034     # the last call: check all parts, unpack, link
    export PYTHONPATH=/tmp/site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
           VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1

`unpack` reads MANIFEST (written by the builder: each part's name, size and sha256, in order), refuses if a part is
missing or differs, streams the parts in order through Python's own lzma into tarfile (no xz binary needed; the
archive is several .tar.xz streams back to back, read with ignore_zeros) and extracts into /tmp (-> /tmp/site). Then
it makes /tmp/site/nvidia hold, beside the NCCL the bundle carries (torch 2.14 calls ncclCommGrow and 10 more
functions NCCL 2.28.9, the device's, lacks), a link to each of the device's own nvidia/* folders (cu13: cuBLAS,
cudart, cuFFT, ...; cudnn, cusparselt, nvshmem): torch's libraries find them through their RPATH
$ORIGIN/../../nvidia/<pkg>/lib. A warm machine that already unpacked says so and does nothing.
"""
import hashlib
import lzma
import os
import shutil
import sys
import tarfile
import time

STASH = os.environ.get("V034_STASH", "/tmp/v034")
ROOT = os.environ.get("V034_ROOT", "/tmp")  # another root only for a dry run off the device
SITE = os.path.join(ROOT, "site")
MARKER = os.path.join(SITE, ".vllm034-unpacked")


def manifest(src):
    rows = []
    for line in open(os.path.join(src, "MANIFEST")):
        if line.strip() and not line.startswith("#"):
            name, size, sha = line.split()
            rows.append((name, int(size), sha))
    return rows


def stash(src):
    os.makedirs(STASH, exist_ok=True)
    for name, size, _ in manifest(src):
        p = os.path.join(src, name)
        if os.path.exists(p) and os.path.getsize(p) == size:
            shutil.copyfile(p, os.path.join(STASH, name))
    shutil.copyfile(os.path.join(src, "MANIFEST"), os.path.join(STASH, "MANIFEST"))
    have = sorted(n for n in os.listdir(STASH) if n != "MANIFEST")
    print(f"stashed in {STASH}: {len(have)} of {len(manifest(src))} parts ({', '.join(have)})")


class Joined:
    """The parts, in order, read as one file (no joined copy on disk)."""

    def __init__(self, paths):
        self.files = [open(p, "rb") for p in paths]
        self.i = 0

    def read(self, n=-1):
        out = b""
        while self.i < len(self.files) and (n < 0 or len(out) < n):
            chunk = self.files[self.i].read(-1 if n < 0 else n - len(out))
            if not chunk:
                self.i += 1
                continue
            out += chunk
        return out


def device_nvidia():
    """The device's own site-packages/nvidia (the one its torch 2.11 loads), not /tmp/site's."""
    if os.environ.get("V034_DEVICE_NVIDIA"):  # for a dry run off the device
        return os.environ["V034_DEVICE_NVIDIA"]
    for p in sys.path:
        cand = os.path.join(p, "nvidia")
        if p and not p.startswith(SITE) and os.path.isdir(os.path.join(cand, "cu13")):
            return cand
    raise SystemExit("no nvidia/cu13 folder on this interpreter's path outside /tmp/site")


def unpack(src):
    if os.path.exists(MARKER):
        print(f"{SITE}: already unpacked (warm machine)")
        return
    if os.path.isdir(src):
        stash(src)
    rows = manifest(STASH)
    t = time.time()
    for name, size, sha in rows:
        p = os.path.join(STASH, name)
        if not os.path.exists(p):
            raise SystemExit(f"{name}: missing (carry it in an earlier call while the machine is warm)")
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if os.path.getsize(p) != size or h.hexdigest() != sha:
            raise SystemExit(f"{name}: size or sha256 differs from MANIFEST")
    print(f"{len(rows)} parts checked in {time.time() - t:.1f} s")
    t = time.time()
    # LZMAFile reads xz streams back to back (tarfile's own "r|xz" stops after the first)
    with lzma.LZMAFile(Joined([os.path.join(STASH, n) for n, _, _ in rows])) as xzf, \
            tarfile.open(fileobj=xzf, mode="r|", ignore_zeros=True) as tf:
        tf.extractall(ROOT, filter="fully_trusted")
    print(f"unpacked to {SITE} in {time.time() - t:.1f} s")
    nv = device_nvidia()
    ours = os.path.join(SITE, "nvidia")
    os.makedirs(ours, exist_ok=True)
    linked = []
    for name in sorted(os.listdir(nv)):
        if not os.path.exists(os.path.join(ours, name)):
            os.symlink(os.path.join(nv, name), os.path.join(ours, name))
            linked.append(name)
    print(f"{ours}: carried {sorted(set(os.listdir(ours)) - set(linked))}, linked from {nv}: {linked}")
    open(MARKER, "w").write(time.strftime("%F %T\n"))
    for name in rows:
        os.remove(os.path.join(STASH, name[0]))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("stash", "unpack"):
        raise SystemExit(__doc__)
    {"stash": stash, "unpack": unpack}[sys.argv[1]](sys.argv[2])
