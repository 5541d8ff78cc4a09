#!/usr/bin/env python3
"""gguf_template.py: puts a chat template into a GGUF file, for trying coli's template
renderer (and `coli serve`'s chat prompts) on a model whose own template is another one.

    python3 tests/gguf_template.py SRC.gguf DST.gguf TEMPLATE_FILE

DST is SRC with the string key `tokenizer.chat_template` set to the bytes of TEMPLATE_FILE:
replaced where SRC has the key (it keeps its place), appended as a new key otherwise. Every
other key and every tensor info is copied byte for byte; tensor offsets count from the data
section, so they stay valid when the data section is re-aligned (general.alignment, default
32) after the new header. The tensor data is streamed, not read into memory: files run to
tens of GiB. GGUF v2 and v3, little-endian (the layout is the one coli.c §2 reads).
Exit status 1 with one line on stderr for a file that is not GGUF or is cut short.
"""
import os
import shutil
import struct
import sys

TEMPLATE_KEY = b"tokenizer.chat_template"
VALUE_STRING, VALUE_ARRAY = 8, 9
# Bytes of each fixed-size value type by id (uint8 .. float64); strings and arrays are None.
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
DEFAULT_ALIGNMENT = 32
COPY_CHUNK = 16 << 20  # 16 MiB per read while copying the data section


class GGUFError(Exception):
    pass


class HeaderReader:
    """Reads the header from a file at POS, keeping the raw bytes of what it reads since mark()."""

    def __init__(self, f, path, pos):
        self.f, self.path = f, path
        self.pos = pos
        self.raw = []

    def take(self, n, where):
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFError(f"{self.path}: file is truncated ({where})")
        self.pos += n
        self.raw.append(b)
        return b

    def u32(self, where):
        return struct.unpack("<I", self.take(4, where))[0]

    def u64(self, where):
        return struct.unpack("<Q", self.take(8, where))[0]

    def string(self, where):
        return self.take(self.u64(where), where)

    def mark(self):
        self.raw = []

    def since_mark(self):
        return b"".join(self.raw)


def skip_value(r, vtype, where):
    """Reads past one value of VTYPE; returns its bytes when it is a fixed-size scalar."""
    if vtype == VALUE_STRING:
        r.string(where)
    elif vtype == VALUE_ARRAY:
        elem_type = r.u32(where)
        count = r.u64(where)
        if elem_type in VALUE_SIZES:
            r.take(count * VALUE_SIZES[elem_type], where)
        else:
            for _ in range(count):
                skip_value(r, elem_type, where)
    elif vtype in VALUE_SIZES:
        return r.take(VALUE_SIZES[vtype], where)
    else:
        raise GGUFError(f"{r.path}: unknown metadata value type {vtype} ({where})")
    return None


def read_header(f, path):
    """Returns (version, n_tensors, kvs as [(key, raw bytes)], raw tensor infos, alignment,
    offset of SRC's data section)."""
    magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (bad magic)")
    r = HeaderReader(f, path, len(magic))
    version = r.u32("version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (2 and 3, little-endian, are read)")
    n_tensors = r.u64("tensor count")
    n_kvs = r.u64("metadata count")
    kvs = []
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kvs):
        r.mark()
        key = r.string("metadata key")
        vtype = r.u32("metadata value type")
        scalar = skip_value(r, vtype, "metadata value")
        if key == b"general.alignment" and vtype in INTEGER_FORMATS:
            alignment = struct.unpack(INTEGER_FORMATS[vtype], scalar)[0]
        kvs.append((key, r.since_mark()))
    if alignment < 1 or alignment > 65536 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment {alignment} is not a power of two up to 65536")
    r.mark()
    for _ in range(n_tensors):
        r.string("tensor name")
        n_dims = r.u32("tensor rank")
        r.take(8 * n_dims + 4 + 8, "tensor info")  # dimensions, type, offset
    tensor_infos = r.since_mark()
    data_start = -(-r.pos // alignment) * alignment
    return version, n_tensors, kvs, tensor_infos, alignment, data_start


def template_kv(text):
    return struct.pack("<Q", len(TEMPLATE_KEY)) + TEMPLATE_KEY + struct.pack("<IQ", VALUE_STRING, len(text)) + text


def write_copy(src, dst, text):
    with open(src, "rb") as f:
        version, n_tensors, kvs, tensor_infos, alignment, data_start = read_header(f, src)
        new_kv = template_kv(text)
        out_kvs = [new_kv if key == TEMPLATE_KEY else raw for key, raw in kvs]
        if all(key != TEMPLATE_KEY for key, _ in kvs):
            out_kvs.append(new_kv)
        header = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(out_kvs)) + b"".join(out_kvs) + tensor_infos
        src_size = os.fstat(f.fileno()).st_size
        # A file without tensors may end before its padding; then there is no data section.
        has_data = data_start < src_size
        padding = -len(header) % alignment if has_data else 0
        tmp = dst + ".tmp"
        try:
            with open(tmp, "wb") as o:
                o.write(header + b"\0" * padding)
                if has_data:
                    f.seek(data_start)
                    shutil.copyfileobj(f, o, COPY_CHUNK)
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


def main(argv):
    if len(argv) != 4:
        print("usage: gguf_template.py SRC.gguf DST.gguf TEMPLATE_FILE", file=sys.stderr)
        return 2
    src, dst, template_path = argv[1:]
    try:
        if os.path.exists(dst) and os.path.samefile(src, dst):
            raise GGUFError(f"{dst}: is SRC itself; write the copy elsewhere")
        with open(template_path, "rb") as t:
            text = t.read()
        write_copy(src, dst, text)
    except (GGUFError, OSError) as e:
        print(f"gguf_template.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
