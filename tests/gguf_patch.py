#!/usr/bin/env python3
"""gguf_patch.py: copies of a GGUF file with one deliberate defect, for coli's tests.

    python3 tests/gguf_patch.py SRC DST retype FROM_ID TO_ID
        every tensor of type id FROM_ID declared as TO_ID (a format of smaller blocks, so the
        data still lies inside the file), e.g. IQ3_XXS (18) as IQ2_XXS (16);
    python3 tests/gguf_patch.py SRC DST scale TENSOR VALUE
        the scale field of every block of TENSOR set to VALUE (hex; an fp16 or, for MXFP4, an
        E8M0 byte), e.g. 7e00: a NaN, 7c00: infinity.

GGUF v3 little-endian, the header layout coli.c §2 reads; exit status 1 with one line on
stderr for a file it cannot follow.
"""
import struct
import sys

VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# type id -> (elements per block, bytes per block, offset of the scale, its bytes)
SCALES = {8: (32, 34, 0, 2), 2: (32, 18, 0, 2), 10: (256, 84, 80, 2), 11: (256, 110, 108, 2),
          12: (256, 144, 0, 2), 14: (256, 210, 208, 2), 18: (256, 98, 0, 2), 20: (32, 18, 0, 2), 21: (256, 110, 0, 2),
          23: (256, 136, 0, 2), 39: (32, 17, 0, 1)}


def tensor_infos(b):
    """[(name, n_elems, type, type_at, offset)] and the data section's start."""
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
    pos, alignment = 24, 32

    def skip(t):
        nonlocal pos
        if t == 8:
            pos += 8 + struct.unpack_from("<Q", b, pos)[0]
        elif t == 9:
            et, cnt = struct.unpack_from("<IQ", b, pos)
            pos += 12
            for _ in range(cnt):
                skip(et)
        else:
            pos += VALUE_SIZES[t]

    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", b, pos)[0]
        key = bytes(b[pos + 8:pos + 8 + klen])
        pos += 8 + klen
        t = struct.unpack_from("<I", b, pos)[0]
        pos += 4
        if key == b"general.alignment" and t == 4:
            alignment = struct.unpack_from("<I", b, pos)[0]
        skip(t)
    infos = []
    for _ in range(n_tensors):
        nlen = struct.unpack_from("<Q", b, pos)[0]
        name = bytes(b[pos + 8:pos + 8 + nlen]).decode()
        pos += 8 + nlen
        nd = struct.unpack_from("<I", b, pos)[0]
        n = 1
        for d in struct.unpack_from("<%dQ" % nd, b, pos + 4):
            n *= d
        pos += 4 + 8 * nd
        t, off = struct.unpack_from("<IQ", b, pos)
        infos.append((name, n, t, pos, off))
        pos += 12
    return infos, (pos + alignment - 1) // alignment * alignment


def main(argv):
    src, dst, mode = argv[1], argv[2], argv[3]
    b = bytearray(open(src, "rb").read())
    infos, data = tensor_infos(b)
    if mode == "retype":
        for _, _, t, at, _ in infos:
            if t == int(argv[4]):
                struct.pack_into("<I", b, at, int(argv[5]))
    elif mode == "scale":
        hit = [i for i in infos if i[0] == argv[4]]
        if not hit or hit[0][2] not in SCALES:
            raise ValueError(f"{src}: no tensor {argv[4]} of a type with a known scale field")
        _, n, t, _, off = hit[0]
        elems, size, at, width = SCALES[t]
        v = int(argv[5], 16).to_bytes(width, "little")
        for k in range(n // elems):
            p = data + off + k * size + at
            b[p:p + width] = v
    else:
        raise ValueError(f"unknown mode {mode}")
    open(dst, "wb").write(b)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except (ValueError, IndexError, struct.error, OSError) as e:
        print(f"gguf_patch.py: {e}", file=sys.stderr)
        sys.exit(1)
