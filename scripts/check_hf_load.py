#!/usr/bin/env python3
"""Load a grpo checkpoint in transformers and compare its per-token log-probs with `grpo logprobs`.

    python3 scripts/check_hf_load.py CHECKPOINT_DIR [GRPO_BIN]

Prints the max |difference| and exits non-zero above 1e-3. Used on the final checkpoint of
`grpo train --config configs/smoke.toml` (result in benches/results/smoke-checkpoint-hf.txt).
"""
import json, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ckpt = sys.argv[1]
grpo = sys.argv[2] if len(sys.argv) > 2 else "target/release/grpo"
text = "Solve 2x + 3 = 11. Subtracting 3 gives 2x = 8, so x = 4. The answer is \\boxed{4}."
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(ckpt)
ids = tok(text).input_ids
with torch.no_grad():
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
hf = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
with tempfile.TemporaryDirectory() as d:
    inp, out = f"{d}/in.jsonl", f"{d}/out.jsonl"
    open(inp, "w").write(json.dumps({"text": text}) + "\n")
    subprocess.run([grpo, "-q", "logprobs", "--model", ckpt, "--input", inp, "--output", out], check=True)
    ours = json.loads(open(out).readline())
assert ours["tokens"] == ids[1:], "tokenisation differs"
diff = max(abs(a - b) for a, b in zip(ours["logprobs"], hf))
print(f"checkpoint {ckpt}: loaded by transformers {__import__('transformers').__version__} "
      f"({model.config.model_type}, {sum(p.numel() for p in model.parameters())} parameters); "
      f"{len(hf)} log-probs, max |grpo - transformers| = {diff:.2e}")
sys.exit(0 if diff < 1e-3 else 1)
