#!/usr/bin/env python3
"""q4train's PEFT adapter against peft (scripts/bench/lora.sh runs it on the GPU machine).

  lora_peft_check.py ids OUT_IDS.dat VOCAB
      writes fixed token ids (input_ids, labels: int64 [2, 64]) for q4grad --inputs
  lora_peft_check.py compare BASE_HF_DIR ADAPTER_DIR IDS.dat Q4GRAD_OUT.dat [--base-dat BASE.dat]
      loads the dequantized base (q4dat export-hf --format bf16) in fp32 with transformers, puts
      the adapter on it with peft, and compares its logits with q4grad --adapter's (q4train's
      plain-LoRA forward, fp32). The NVFP4 linears are exact in bf16 (a code times an E4M3 scale
      has at most 5 significant bits), but the export rounds the fp16 embedding and norms to
      bf16: --base-dat (the base .dat) puts the file's own 16-bit values back first. Prints
      RESULT {json}: the largest logit difference relative to the largest logit, and the same
      without the adapter (a control that must be much larger when the adapter has trained).
      Exit 1 when the relative difference exceeds --tol (1e-3: fp32 against fp32 with other
      kernels; q4grad fake-quantizes the frozen linears once more, which moves rare blocks).
      The adapter's modules_to_save weights (norms trained beside the adapters) must each be
      what peft put in its wrapper of that module (RESULT's modules_to_save counts them).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures"))
from make_plain_fixture import read_dat, tensor_entry, write_dat  # noqa: E402


def logits_of(dat):
    et, shape, payload = read_dat(dat)["logits"]
    assert et == 6, "q4grad writes fp32 logits"
    return torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(shape)


def ids_of(dat):
    et, shape, payload = read_dat(dat)["input_ids"]
    return torch.frombuffer(bytearray(payload), dtype=torch.int64).reshape(shape)


def restore_raw_entries(model, dat):
    """Copies the .dat's raw fp16/bf16/fp32 entries (embedding, norms) over the model's."""
    kinds = {5: torch.float16, 15: torch.bfloat16, 6: torch.float32}
    params = dict(model.named_parameters())
    n = 0
    for key, (et, shape, payload) in read_dat(dat).items():
        if et not in kinds or key not in params:
            continue
        t = torch.frombuffer(bytearray(payload), dtype=kinds[et]).reshape(shape).float()
        with torch.no_grad():
            params[key].copy_(t)
        n += 1
    assert n > 0, dat + ": no raw entry matched the model's parameter names"
    return n


def check_modules_to_save(peft_model, adapter):
    """Every non-LoRA tensor of the adapter is the active copy in peft's wrapper of its module."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    prefix = "base_model.model."
    n = 0
    for key, value in tensors.items():
        if "lora_" in key:
            continue
        assert key.startswith(prefix) and key.endswith(".weight"), key
        module = peft_model.base_model.model.get_submodule(key[len(prefix):-len(".weight")])
        assert hasattr(module, "modules_to_save"), key + ": peft did not wrap its module"
        active = module.modules_to_save["default"].weight.detach().float().cpu()
        assert torch.equal(active, value.float()), key + ": peft's copy differs from the file"
        n += 1
    return n


def main():
    if sys.argv[1] == "ids":
        out, vocab = sys.argv[2], int(sys.argv[3])
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, vocab, (2, 64), generator=g)
        write_dat(out, [("input_ids", tensor_entry(ids)), ("labels", tensor_entry(ids.clone()))])
        return 0
    assert sys.argv[1] == "compare", __doc__
    base, adapter, ids_path, q4_out = sys.argv[2:6]
    tol = float(sys.argv[sys.argv.index("--tol") + 1]) if "--tol" in sys.argv else 1e-3
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if "--base-dat" in sys.argv:
        restored = restore_raw_entries(model, sys.argv[sys.argv.index("--base-dat") + 1])
        print(f"restored {restored} raw 16-bit entries from the base .dat")
    model = model.to(dev)
    ids = ids_of(ids_path).to(dev)
    with torch.no_grad():
        plain = model(ids).logits.float().cpu()
        peft_model = PeftModel.from_pretrained(model, adapter).to(dev)
        adapted = peft_model(ids).logits.float().cpu()
    saved = check_modules_to_save(peft_model, adapter)
    q4 = logits_of(q4_out)
    scale = q4.abs().max().item()
    rel = (adapted - q4).abs().max().item() / scale
    control = (plain - q4).abs().max().item() / scale
    print("RESULT " + json.dumps({"max_rel_diff": rel, "without_adapter_rel_diff": control,
                                  "max_abs_logit": scale, "tol": tol,
                                  "modules_to_save": saved}))
    return 0 if rel <= tol and control > 10 * rel else 1


if __name__ == "__main__":
    sys.exit(main())
