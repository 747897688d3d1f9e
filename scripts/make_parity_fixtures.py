#!/usr/bin/env python3
"""Reference log-probs from Hugging Face transformers, committed as test fixtures so CI needs no Python.

    cargo build --release
    python3 scripts/make_parity_fixtures.py --grpo target/release/grpo --out tests/fixtures/parity

For each architecture (qwen2, qwen3, llama) it asks `grpo init-tiny` for a small random model (the files
grpo writes: this also checks that transformers loads grpo's checkpoints), loads it in transformers (f32,
eager attention) and records per-token log-probs of a few texts and of a chat (prompt, response) pair.
With --smollm2 DIR it does the same for the real SmolLM2-135M and records greedy generations.
Needs: torch, transformers.
"""
import argparse, json, os, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "data", "tokenizers")
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=7)
TOKENIZERS = {"qwen2": "qwen3", "qwen3": "qwen3", "llama": "llama3"}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Solve 2x + 3 = 11. Subtracting 3 gives 2x = 8, so x = 4. The answer is \\boxed{4}.",
    "Let $a_1 = 1$ and $a_{n+1} = 2a_n + 1$. Then $a_n = 2^n - 1$, which for n = 10 gives 1023. " * 3,
]
CHAT = {"prompt": "What is 7 times 6?", "response": "7 times 6 is 42. The answer is \\boxed{42}."}


@torch.no_grad()
def logprobs(model, ids):
    x = torch.tensor([ids])
    logits = model(x).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def cases(model, tok):
    out = []
    for text in TEXTS:
        ids = tok(text).input_ids
        out.append({"text": text, "tokens": ids, "logprobs": logprobs(model, ids)})
    prompt = tok.apply_chat_template([{"role": "user", "content": CHAT["prompt"]}], add_generation_prompt=True, tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    r_ids = tok(CHAT["response"], add_special_tokens=False).input_ids
    lp = logprobs(model, p_ids + r_ids)[len(p_ids) - 1:]
    out.append({**CHAT, "prompt_tokens": p_ids, "tokens": r_ids, "logprobs": lp})
    return out


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smollm2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch, tokname in TOKENIZERS.items():
            d = os.path.join(tmp, arch)
            cmd = [args.grpo, "init-tiny", "--arch", arch, "--tokenizer", os.path.join(SHARED, tokname), "--out", d]
            for k, v in TINY.items():
                cmd += ["--" + k.replace("_", "-"), str(v)]
            subprocess.run(cmd, check=True)
            model, tok = load(d)
            fixture = {"arch": arch, "tokenizer": tokname, "init": TINY, "transformers": __import__("transformers").__version__,
                       "cases": cases(model, tok)}
            json.dump(fixture, open(os.path.join(args.out, f"tiny-{arch}.json"), "w"), indent=1)
            print(f"tiny-{arch}: {sum(len(c['logprobs']) for c in fixture['cases'])} log-probs")
    if args.smollm2:
        model, tok = load(args.smollm2)
        fixture = {"arch": "llama", "model": "smollm2-135m-instruct", "transformers": __import__("transformers").__version__,
                   "cases": cases(model, tok), "generations": []}
        for q in ["What is the capital of France?", "What is 2 + 2?"]:
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
            new = out[0, ids.shape[1]:].tolist()
            fixture["generations"].append({"prompt": q, "prompt_tokens": ids[0].tolist(), "tokens": new,
                                           "text": tok.decode(new, skip_special_tokens=True)})
            print(q, "->", repr(fixture["generations"][-1]["text"]))
        json.dump(fixture, open(os.path.join(args.out, "smollm2.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
