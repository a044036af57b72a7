#!/usr/bin/env python3
"""q4train's PEFT adapter on mixture-of-experts experts against peft (docs/model.md#lora-on-experts);
scripts/interop/peft_moe_check.sh runs it on the GPU machine (torch, transformers 5, peft,
safetensors; no network).

  peft_moe_check.py make-base HF_DIR
      a tiny Qwen3MoeForCausalLM (2 layers of 8 experts of width 96, top 2, hidden 64, the Qwen3
      vocabulary: with the script's rank 16, H, I and r·E are 64, 96 and 128, so every expert
      adapter tensor's shape tells in from out) with seeded random weights, saved with
      save_pretrained (fp32). A checkpoint that holds transformers' fused in-memory experts
      (mlp.experts.gate_up_proj) is rewritten with per-expert tensors, the layout q4dat
      import-hf reads; the script says which it found.
  peft_moe_check.py ids OUT_IDS.dat VOCAB
      fixed token ids (input_ids, labels: int64 [2, 48]) for q4grad --inputs.
  peft_moe_check.py compare BASE_HF_DIR ADAPTER_DIR IDS.dat Q4GRAD_OUT.dat --base-dat BASE.dat
                    [--merged Q4GRAD_MERGED.dat] [--label NAME] [--tol 1e-3]
      (a) peft's layout: the adapter file's keys and shapes equal get_peft_state_dict of a fresh
          get_peft_model(base, LoraConfig(the folder's target_modules, target_parameters,
          modules_to_save, ...)) on this peft, and PeftModel.from_pretrained holds every tensor of
          the file bit for bit (peft only warns about keys it does not take);
      (b) logits: peft's model on the dequantized base (q4dat export-hf --format bf16, fp32,
          its raw 16-bit entries put back from BASE.dat as lora_peft_check.py does) against
          q4grad --adapter's (q4train's plain-LoRA forward, fp32). The NVFP4 linears are exact in
          bf16, so both compute the same function in fp32 with other kernels and summation
          orders: --tol bounds the largest difference relative to the largest logit (1e-3, as
          the dense check). Two controls must each move the logits by more than 10x that
          difference: the base without the adapter, and the adapter with its expert lora_B
          zeroed (the experts' adapters matter, so their layout is what is checked).
          --merged (q4grad of the run's merged .dat export) is reported, not checked: the
          export requantizes W + s*B*A to NVFP4.
      Prints RESULT {json}; exit 1 on any mismatch.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from make_plain_fixture import tensor_entry, write_dat  # noqa: E402
from lora_peft_check import ids_of, logits_of, restore_raw_entries  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 64, "intermediate_size": 192,
    "moe_intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "rope_theta": 1000000.0, "bos_token_id": None,
    "eos_token_id": 151645, "use_sliding_window": False,
}
SEQ = 48


def per_expert(st):
    """transformers' fused experts (gate_up_proj (E, 2I, H), gate rows first; down_proj (E, H, I))
    as per-expert tensors; other tensors as they are. Returns (tensors, fused tensors found)."""
    E, I = CONFIG["num_experts"], CONFIG["moe_intermediate_size"]
    out, fused = {}, 0
    for k, v in st.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(E):
                out[pre + "%d.gate_proj.weight" % e] = v[e, :I].contiguous()
                out[pre + "%d.up_proj.weight" % e] = v[e, I:].contiguous()
            fused += 1
        elif k.endswith(".mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(E):
                out[pre + "%d.down_proj.weight" % e] = v[e].contiguous()
            fused += 1
        else:
            out[k] = v
    return out, fused


def make_base(out_dir):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(dict(CONFIG))).float()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # router: distinct routings
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # (out, in) or fused experts (E, out, in)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    sharded = os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
    fused = 0
    for f in files:
        path = os.path.join(out_dir, f)
        st, n = per_expert(load_file(path))
        if n and sharded:
            sys.exit("make-base: a sharded checkpoint with fused experts; not rewritten")
        if n:
            save_file(st, path, metadata={"format": "pt"})
        fused += n
    keys = sorted(k for f in files for k in load_file(os.path.join(out_dir, f)))
    print("make-base: save_pretrained wrote %s experts (%d fused tensors rewritten per expert); "
          "%d tensors, e.g. %s" % ("fused" if fused else "per-expert", fused, len(keys),
                                   [k for k in keys if "layers.0.mlp" in k][:3]))
    return 0


def load_base(base_dir, dev):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: info.get(k) for k in ("missing_keys", "mismatched_keys") if info.get(k)}
    assert not bad, base_dir + ": transformers did not load every tensor: " + repr(bad)
    if info.get("unexpected_keys"):
        print("load_base: transformers left out %s" % sorted(info["unexpected_keys"])[:8])
    # The reference loop over experts (transformers 5 may default to grouped GEMMs); peft's
    # ParamWrapper feeds either the same W + delta.
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001 (a report, the default stays)
            print("load_base: experts implementation left as it is (%s)" % e)
    return model.to(dev).eval()


def experts_nesting(peft_model):
    """'ParamWrapper(down_proj) > ParamWrapper(gate_up_proj) > Qwen3MoeExperts' of layer 0."""
    m = peft_model.base_model.model.model.layers[0].mlp.experts
    out = []
    while hasattr(m, "base_layer"):
        out.append("%s(%s)" % (type(m).__name__, getattr(m, "parameter_name", "?")))
        m = m.base_layer
    return " > ".join(out + [type(m).__name__])


def check_layout(base_dir, adapter, dev):
    """(a): the file against peft's own state dict of a fresh model with the folder's config."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    lc = LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                    target_modules=cfg["target_modules"],
                    target_parameters=cfg.get("target_parameters"),
                    modules_to_save=cfg.get("modules_to_save"),
                    layers_to_transform=cfg.get("layers_to_transform"), task_type="CAUSAL_LM")
    fresh = get_peft_model(load_base(base_dir, dev), lc)
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(fresh).items()}
    nesting = experts_nesting(fresh)
    del fresh
    have = {k: tuple(v.shape) for k, v in load_file(
        os.path.join(adapter, "adapter_model.safetensors")).items()}
    problems = ["only in peft's: %s %s" % (k, want[k]) for k in sorted(set(want) - set(have))]
    problems += ["only in q4's: %s %s" % (k, have[k]) for k in sorted(set(have) - set(want))]
    problems += ["shape of %s: q4 %s, peft %s" % (k, have[k], want[k])
                 for k in sorted(set(want) & set(have)) if want[k] != have[k]]
    for p in problems[:20]:
        print("layout: " + p)
    print("layout: %d tensors in the file, %d in peft's fresh state dict; experts nesting %s"
          % (len(have), len(want), nesting))
    return problems, nesting, len(have)


def check_loaded(peft_model, adapter):
    """Every tensor of the file is what PeftModel.from_pretrained holds under that key."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    loaded = get_peft_model_state_dict(peft_model)
    problems = []
    for k, v in load_file(os.path.join(adapter, "adapter_model.safetensors")).items():
        if k not in loaded:
            problems.append("peft holds no " + k)
        elif not torch.equal(loaded[k].detach().float().cpu(), v.float()):
            problems.append("peft's %s differs from the file's" % k)
    for p in problems[:20]:
        print("loaded: " + p)
    return problems


def rel(a, b, scale):
    return (a - b).abs().max().item() / scale


def compare(argv):
    base, adapter, ids_path, q4_out = argv[:4]
    opt = lambda name, default=None: argv[argv.index(name) + 1] if name in argv else default
    tol = float(opt("--tol", "1e-3"))
    label = opt("--label", os.path.basename(os.path.normpath(adapter)))
    from peft import PeftModel
    import peft
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("%s: torch %s, transformers %s, peft %s, %s" % (
        label, torch.__version__, transformers.__version__, peft.__version__, dev))
    layout_problems, nesting, n_tensors = check_layout(base, adapter, dev)

    model = load_base(base, "cpu")
    assert opt("--base-dat"), "compare: --base-dat BASE.dat is required"
    restored = restore_raw_entries(model, opt("--base-dat"))
    print("restored %d raw 16-bit entries from the base .dat" % restored)
    model = model.to(dev)
    ids = ids_of(ids_path).to(dev)
    with torch.no_grad():
        plain = model(ids).logits.float().cpu()
        peft_model = PeftModel.from_pretrained(model, adapter).to(dev).eval()
        adapted = peft_model(ids).logits.float().cpu()
        load_problems = check_loaded(peft_model, adapter)
        zeroed = 0
        for name, p in peft_model.named_parameters():
            if ".mlp.experts." in name and "lora_B" in name:
                p.zero_()
                zeroed += 1
        no_experts = peft_model(ids).logits.float().cpu()
    q4 = logits_of(q4_out)
    scale = q4.abs().max().item()
    per_token = (adapted - q4).abs().amax(-1) / scale  # (B, T)
    r = {
        "label": label, "max_rel_diff": rel(adapted, q4, scale), "tol": tol,
        "tokens_over_tol": int((per_token > tol).sum()), "tokens": per_token.numel(),
        "without_adapter_rel_diff": rel(plain, q4, scale),
        "without_expert_adapters_rel_diff": rel(no_experts, q4, scale),
        "expert_lora_B_zeroed": zeroed, "max_abs_logit": scale, "adapter_tensors": n_tensors,
        "layout_problems": len(layout_problems), "load_problems": len(load_problems),
        "experts_nesting": nesting,
        "experts_implementation": str(getattr(model.config, "_experts_implementation", "n/a")),
    }
    if opt("--merged"):
        r["merged_export_rel_diff"] = rel(adapted, logits_of(opt("--merged")), scale)
    ok = (not layout_problems and not load_problems and zeroed > 0 and r["max_rel_diff"] <= tol
          and r["without_adapter_rel_diff"] > 10 * r["max_rel_diff"]
          and r["without_expert_adapters_rel_diff"] > 10 * r["max_rel_diff"])
    r["ok"] = ok
    print("RESULT " + json.dumps(r))
    return 0 if ok else 1


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "make-base":
        return make_base(sys.argv[2])
    if cmd == "ids":
        out, vocab = sys.argv[2], int(sys.argv[3])
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, vocab, (2, SEQ), generator=g)
        write_dat(out, [("input_ids", tensor_entry(ids)), ("labels", tensor_entry(ids.clone()))])
        return 0
    if cmd == "compare":
        return compare(sys.argv[2:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
