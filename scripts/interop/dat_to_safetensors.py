# Writes a Hugging Face BF16 folder (one model.safetensors + config.json) from a .dat whose
# entries are all raw bf16 (q4dat dequantize --dtype bf16): the payload bytes are copied as is.
import json, shutil, struct, sys
src, out_dir, config = sys.argv[1:4]
def uleb(f):
    v = s = 0
    while True:
        b = f.read(1)[0]; v |= (b & 0x7F) << s; s += 7
        if b < 0x80: return v
SIZES = {15: 2, 5: 2, 6: 4}
NAMES = {15: "BF16", 5: "F16", 6: "F32"}
entries = []
with open(src, "rb") as f:
    for _ in range(uleb(f)):
        key = f.read(uleb(f)).decode(); et = uleb(f); shape = [uleb(f) for _ in range(uleb(f))]
        n = 1
        for d in shape: n *= d
        entries.append((key, et, shape, f.tell(), n * SIZES[et])); f.seek(n * SIZES[et], 1)
hdr, off = {}, 0
for key, et, shape, pos, nb in entries:
    hdr[key] = {"dtype": NAMES[et], "shape": shape, "data_offsets": [off, off + nb]}; off += nb
h = json.dumps(hdr).encode(); h += b" " * ((8 - len(h) % 8) % 8)
import os; os.makedirs(out_dir, exist_ok=True)
with open(src, "rb") as f, open(os.path.join(out_dir, "model.safetensors"), "wb") as o:
    o.write(struct.pack("<Q", len(h))); o.write(h)
    for key, et, shape, pos, nb in entries:
        f.seek(pos)
        while nb:
            chunk = f.read(min(nb, 64 << 20)); o.write(chunk); nb -= len(chunk)
shutil.copy(config, os.path.join(out_dir, "config.json"))
print(out_dir, len(entries), "tensors", off, "bytes")
