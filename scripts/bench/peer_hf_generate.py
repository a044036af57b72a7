# The rollout peer: HF transformers generate() on the same weights (a BF16 folder), sampling
# PROMPTS random prompts of PROMPT_LEN tokens NUM_GEN times each for exactly NEW_TOKENS tokens
# (min_new_tokens = max_new_tokens: no row stops early, as bench_model runs), temperature 1,
# top-k/top-p off, a static KV cache (CACHE=static; CACHE=dynamic for the default). One warm-up,
# then REPEATS timed runs. Prints RESULT {json} with the median generated tokens/s.
#   python3 scripts/bench/peer_hf_generate.py MODEL_DIR
import json, os, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

model_dir = sys.argv[1]
P, G = int(os.environ.get("PROMPTS", 64)), int(os.environ.get("NUM_GEN", 8))
L, N = int(os.environ.get("PROMPT_LEN", 128)), int(os.environ.get("NEW_TOKENS", 512))
repeats, cache = int(os.environ.get("REPEATS", 2)), os.environ.get("CACHE", "static")
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
torch.manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, (P, L), device="cuda")
gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=N,
                       min_new_tokens=N, num_return_sequences=G, eos_token_id=None,
                       pad_token_id=0, cache_implementation=cache)
rates = []
for r in range(repeats + 1):
    torch.cuda.synchronize(); t0 = time.time()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=gen)
    torch.cuda.synchronize(); s = time.time() - t0
    new = (out.shape[1] - L) * out.shape[0]
    print(f"peer {'warm-up' if r == 0 else 'timed'} run: {out.shape[0]} rows x {out.shape[1] - L} "
          f"new tokens in {s:.2f} s = {new / s:.0f} tok/s", flush=True)
    if r > 0: rates.append(new / s)
import transformers
print("RESULT " + json.dumps({"tool": "hf_generate", "transformers": transformers.__version__,
      "cache": cache, "rows": P * G, "prompt_len": L, "new_tokens": N,
      "tok_s": round(statistics.median(rates), 1),
      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}))
