"""Drop from CUDA libraries' fatbins the images an sm_90 GPU (H100/H200) never loads, so they compress small.

The method of ../shared/gpu-vllm/prune_fatbin.py (the vLLM 0.26 bundle's), extended for the vLLM 0.34 bundle
(bench/gpu_vllm034_bundle.sh) to every fatbin section a library has: `.nv_fatbin` (what the CUDA runtime loads) and
`__nv_relfatbin` (relocatable device code, e.g. NCCL 2.30's and libtorch_nvshmem's), and to libraries that have none
(left as they are). Each fatbin container is rewritten in place, at the same offset, holding only its sm_90 / sm_90a
cubins; its PTX only where it has no such cubin (the driver JIT-compiles it, as it would have); where nothing is
left, its smallest image (no container is empty). Its size field is updated and the freed tail zeroed; the file's
size and every other byte stay as they were, so what an sm_90 GPU loads is byte-identical.

usage: python3 bench/gpu_prune_fatbin.py LIB.so [...]   (rewrites in place; prints bytes of images before -> after)
"""
import struct
import sys

KEEP_ARCH = 90
MAGIC = 0xBA55ED50
HDR = struct.Struct("<HHIQIIHHIIIQQQ")  # kind (1 PTX, 2 ELF), ?, header size, payload size, ..., arch at index 8
SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def sections(data):
    if data[:4] != b"\x7fELF":
        return {}
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    shs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stro = shs[shstrndx][4]
    out = {}
    for name, _t, _f, _a, off, size in shs:
        key = bytes(data[stro + name:data.index(b"\0", stro + name)]).decode()
        if key in SECTIONS:
            out[key] = (off, size)
    return out


def prune_section(data, path, off, size):
    pos, end, before, after, ncont = off, off + size, 0, 0, 0
    while pos < end:
        magic, _v, hs, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            assert data[pos] == 0, f"{path}: no fatbin header at {pos}"
            pos += 1
            continue
        ncont += 1
        entries, e, cend = [], pos + hs, pos + hs + fsz
        while e < cend:
            h = HDR.unpack_from(data, e)
            kind, ehs, psz, arch = h[0], h[2], h[3], h[8]
            entries.append((kind, arch, bytes(data[e:e + ehs + psz])))
            e += ehs + psz
        assert e == cend, f"{path}: container at {pos} does not add up"
        has_sass = any(k == 2 and a == KEEP_ARCH for k, a, _ in entries)
        kept = [b for k, a, b in entries if (k == 2 and a == KEEP_ARCH) or (k == 1 and not has_sass and a <= KEEP_ARCH)]
        if not kept:
            kept = [min((b for _, _, b in entries), key=len)]
        body = b"".join(kept)
        assert len(body) % 8 == 0
        struct.pack_into("<Q", data, pos + 8, len(body))
        data[pos + hs:pos + hs + len(body)] = body
        data[pos + hs + len(body):cend] = bytes(cend - pos - hs - len(body))
        before += fsz
        after += len(body)
        pos = cend
    return ncont, before, after


def prune(path):
    data = bytearray(open(path, "rb").read())
    found = sections(data)
    if not found:
        print(f"{path}: no fatbin, left as it is")
        return
    for name, (off, size) in sorted(found.items()):
        ncont, before, after = prune_section(data, path, off, size)
        print(f"{path} {name}: {ncont} containers, {before / 2**20:.1f} -> {after / 2**20:.1f} MiB of images")
    open(path, "wb").write(data)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        prune(p)
