#!/usr/bin/env python3
"""Load a grpo LoRA adapter with PEFT and compare its per-token log-probs with `grpo logprobs --adapter`.

    python3 scripts/check_peft_load.py BASE_DIR ADAPTER_DIR [GRPO_BIN] [MERGED_DIR]

BASE_DIR is the base model, ADAPTER_DIR a LoRA run's checkpoint (adapter_model.safetensors and
adapter_config.json); MERGED_DIR, when given, is `grpo export --merge` of it, loaded by transformers alone.
Prints the max |difference| and exits non-zero above 1e-3 (f32). tests/lora_cli.rs runs it where PEFT is
installed (GRPO_PEFT_PYTHON, else python3).
"""
import json, subprocess, sys, tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base, adapter = sys.argv[1], sys.argv[2]
grpo = sys.argv[3] if len(sys.argv) > 3 else "target/release/grpo"
merged = sys.argv[4] if len(sys.argv) > 4 else None
text = "Solve 2x + 3 = 11. Subtracting 3 gives 2x = 8, so x = 4. The answer is \\boxed{4}."
tok = AutoTokenizer.from_pretrained(base)
ids = tok(text).input_ids


def logprobs(model):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
peft = logprobs(PeftModel.from_pretrained(model, adapter).eval())
with tempfile.TemporaryDirectory() as d:
    inp, out = f"{d}/in.jsonl", f"{d}/out.jsonl"
    open(inp, "w").write(json.dumps({"text": text}) + "\n")
    cmd = [grpo, "-q", "logprobs", "--model", base, "--adapter", adapter, "--input", inp, "--output", out]
    subprocess.run(cmd, check=True)
    ours = json.loads(open(out).readline())
assert ours["tokens"] == ids[1:], "tokenisation differs"
diff = max(abs(a - b) for a, b in zip(ours["logprobs"], peft))
print(f"adapter {adapter}: loaded by peft {__import__('peft').__version__}; {len(peft)} log-probs, "
      f"max |grpo - peft| = {diff:.2e}")
worst = diff
if merged:
    m = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, attn_implementation="eager").eval()
    d2 = max(abs(a - b) for a, b in zip(logprobs(m), peft))
    print(f"merged {merged}: loaded by transformers; max |merged - peft| = {d2:.2e}")
    worst = max(worst, d2)
sys.exit(0 if worst < 1e-3 else 1)
