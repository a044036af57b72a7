#!/usr/bin/env python3
"""Checks a q4train Hugging Face export with the reference libraries (GPU machine, not CI).

usage: check_hf_export.py EXPORT_DIR DEQUANT_DAT

EXPORT_DIR:  written by `q4dat export-hf` (ModelOpt, compressed-tensors or dense BF16 layout).
DEQUANT_DAT: `q4dat dequantize SOURCE.dat DEQUANT_DAT --dtype fp32` of the exported .dat.

Opens every indexed shard with safetensors.safe_open, loads config.json with
transformers.AutoConfig, dequantizes each NVFP4 linear by the ModelOpt formula
code * weight_scale * weight_scale_2 (compressed-tensors: code * weight_scale / weight_global_scale)
in fp32 and requires it to equal the dense tensor q4dat wrote, bit for bit; raw tensors
(embedding, norms, lm_head) must equal it too after casting to fp32. A BF16 folder (no
quantization_config) must hold every tensor dense and equal, and transformers'
AutoModelForCausalLM must load it and give, on random token ids, the same logits (bit for bit,
fp32, CUDA when present) as the same architecture holding DEQUANT_DAT's tensors. Prints one
PASS/FAIL line.
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
DAT_DTYPES = {5: (torch.float16, 2), 6: (torch.float32, 4), 15: (torch.bfloat16, 2)}


def uleb(f):
    v, shift = 0, 0
    while True:
        b = f.read(1)[0]
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v


def read_dat(path):
    """{key: fp32 tensor} of the float entries of a .dat (the dequantized reference)."""
    out = {}
    with open(path, "rb") as f:
        for _ in range(uleb(f)):
            key = f.read(uleb(f)).decode()
            etype = uleb(f)
            shape = [uleb(f) for _ in range(uleb(f))]
            n = 1
            for d in shape:
                n *= d
            if etype in DAT_DTYPES:
                dt, size = DAT_DTYPES[etype]
                buf = bytearray(f.read(n * size))
                out[key] = torch.frombuffer(buf, dtype=dt).reshape(shape).float() if n else \
                    torch.zeros(shape)
            else:
                size = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 7: 8, 11: 1, 100: 1, 101: 1}[etype]
                f.seek(n * size, 1)
    return out


def e4m3_to_f32(u8):
    """FP8 E4M3FN bits -> fp32 (torch.float8_e4m3fn when present, else by hand)."""
    if hasattr(torch, "float8_e4m3fn"):
        return u8.view(torch.float8_e4m3fn).float()
    b = u8.to(torch.int32)
    s = torch.where((b & 0x80) != 0, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, (b & 7).float()
    v = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).float()))
    return torch.where((b & 0x7F) == 0x7F, float("nan"), s * v)


def dequant(packed_u8, scale_u8, global_mult):
    lo, hi = packed_u8 & 0xF, packed_u8 >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed_u8.shape[0], -1).long()
    vals = E2M1[codes]
    s = e4m3_to_f32(scale_u8).repeat_interleave(16, dim=1)
    return vals * s * global_mult


def logits_differ(export_dir, ref):
    """[] when transformers' model of the folder and of `ref` give equal logits, else a reason."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = AutoModelForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32).to(dev)
    want = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(export_dir),
                                            torch_dtype=torch.float32)
    missing, unexpected = want.load_state_dict(ref, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        return [f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}"]
    if "lm_head.weight" in missing:
        want.tie_weights()
    want = want.to(dev)
    ids = torch.randint(0, got.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = got(ids.to(dev)).logits
        b = want(ids.to(dev)).logits
    if torch.equal(a, b):
        return []
    return [f"logits differ (max abs diff {(a - b).abs().max().item()})"]


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    export_dir, ref_path = sys.argv[1], sys.argv[2]
    AutoConfig.from_pretrained(export_dir)  # must parse as a transformers config
    with open(os.path.join(export_dir, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    dense = qc is None
    ct = not dense and qc["quant_method"] == "compressed-tensors"
    with open(os.path.join(export_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        with safe_open(os.path.join(export_dir, shard), framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    ref = read_dat(ref_path)
    if dense:  # the folder holds the .dat rounded to BF16 (exact for dequantized NVFP4 values)
        ref = {k: v.bfloat16().float() for k, v in ref.items()}
    checked, bad = 0, []
    q_suffix = ".weight_packed" if ct else ".weight"
    for name, want in ref.items():
        mod = name[: -len(".weight")]
        if not dense and mod + ".weight_scale" in tensors:
            packed = tensors[mod + q_suffix]
            scale = tensors[mod + ".weight_scale"]
            if scale.dtype != torch.uint8:
                scale = scale.view(torch.uint8)
            if ct:
                mult = 1.0 / tensors[mod + ".weight_global_scale"].float().reshape(())
            else:
                mult = tensors[mod + ".weight_scale_2"].float().reshape(())
            got = dequant(packed, scale, mult)
        elif name in tensors and (not dense or tensors[name].dtype == torch.bfloat16):
            got = tensors[name].float()
        else:
            bad.append(f"{name}: missing from the export")
            continue
        checked += 1
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            bad.append(f"{name}: differs (max abs diff {diff})")
    if dense and not bad:
        bad += logits_differ(export_dir, ref)
    layout = "bf16" if dense else ("compressed-tensors" if ct else "modelopt")
    status = "PASS" if not bad and checked else "FAIL"
    print(f"{status}: {export_dir} ({layout}): {checked} "
          f"tensors checked against {ref_path}, {len(bad)} differ"
          + (f"; first: {bad[0]}" if bad else ""))
    return 0 if status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
