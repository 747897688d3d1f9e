#!/usr/bin/env python3
"""transformers' greedy answers of SmolLM2-135M on a slice of MATH-500, with the SkyThought prompt, as a
committed fixture for tests/eval_cli.rs (so CI needs no Python).

    python3 scripts/make_eval_fixture.py tests/fixtures/models/smollm2-135m tests/fixtures/parity/smollm2-math500.json
"""
import json, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEMPLATE = "Return your final response within \\boxed{{}}. {problem}"
N_PROBLEMS, MAX_NEW = 4, 160


def main(model_dir, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [json.loads(l) for l in open("data/benchmarks/math500.jsonl")][:N_PROBLEMS]
    results = []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": TEMPLATE.format(problem=r["problem"])}],
                                         add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out_ids = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)[0, ids.shape[1]:].tolist()
        if eos in out_ids:
            out_ids = out_ids[:out_ids.index(eos)]
        results.append({"id": r["unique_id"], "answer": r["answer"], "tokens": out_ids,
                        "text": tok.decode(out_ids, skip_special_tokens=True)})
        print(r["unique_id"], repr(results[-1]["text"][-80:]))
    json.dump({"max_new_tokens": MAX_NEW, "problems": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
