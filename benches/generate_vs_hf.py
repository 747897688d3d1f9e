"""Helper of benches/generate_vs_hf.sh (needs torch + transformers + tokenizers).

  prep  SRC OUT_JSONL N                      first N problems of SRC -> {"id","problem","answer"} JSONL
  hf    PROMPTS MODEL MAX_NEW BATCH LIMIT     greedy transformers generate (f32, CPU, 2 threads) over the
                                             first LIMIT prompts in batches of BATCH; prints a JSON line
  report DATE DEVICE OUT_JSON (B OURS_REPORT HF_JSON)...   table per batch size + ratio; writes OUT_JSON
"""
import json
import os
import sys


def prep(src, out, n):
    with open(out, "w") as f:
        for i, line in enumerate(open(src)):
            if i == n:
                break
            d = json.loads(line)
            f.write(json.dumps({"id": str(d.get("unique_id", i)), "problem": d["problem"], "answer": d["answer"]}) + "\n")


def hf(prompts_path, model_dir, max_new, batch, limit):
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [json.loads(l) for l in open(prompts_path)][:limit]
    probs = [r["problem"] for r in rows]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in probs]
    gen_tokens = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(texts), batch):
            enc = tok(texts[s:s + batch], add_special_tokens=False, return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            for row in out[:, enc.input_ids.shape[1]:].tolist():
                gen_tokens.append(row.index(eos) if eos in row else len(row))
    dt = time.perf_counter() - t0
    prompt_tokens = [len(tok(t, add_special_tokens=False).input_ids) for t in texts]
    print(json.dumps({"batch_size": batch, "n_prompts": len(texts), "generated_tokens": sum(gen_tokens),
                      "ids": [r["id"] for r in rows], "prompt_tokens": prompt_tokens, "per_sequence": gen_tokens, "duration_s": dt, "tokens_per_sec": sum(gen_tokens) / dt,
                      "torch": torch.__version__}))


def report(date, device, out_json, *triples):
    rows = []
    for i in range(0, len(triples), 3):
        b, ours_path, hf_path = int(triples[i]), triples[i + 1], triples[i + 2]
        rep = json.load(open(ours_path))
        (name, ours), = rep["benchmarks"].items()
        h = json.loads(open(hf_path).read().strip().splitlines()[-1])
        gens = {}
        for line in open(os.path.join(os.path.dirname(ours_path), "generations.jsonl")):
            g = json.loads(line)
            gens[g["id"]] = (g["prompt_tokens"], [s["tokens"] for s in g["samples"]])
        ours_seq = [gens[i][1][0] if i in gens else None for i in h["ids"]]
        ours_prompt = [gens[i][0] if i in gens else None for i in h["ids"]]
        rows.append({"batch_size": b, "n_prompts": h["n_prompts"],
                     "ours": {"generated_tokens": ours["generated_tokens"], "duration_s": ours["duration_s"],
                              "tokens_per_sec": ours["tokens_per_sec"], "n_problems": ours["n_problems"],
                              "per_sequence": ours_seq, "prompt_tokens": ours_prompt,
                              "mean_response_tokens": ours.get("mean_response_tokens")},
                     "hf": h, "ratio_ours_over_hf": ours["tokens_per_sec"] / h["tokens_per_sec"]})
    for r in rows:
        o, h = r["ours"], r["hf"]
        print(f"batch {r['batch_size']} ({r['n_prompts']} prompts, max_new_tokens 64, greedy)")
        print(f"  {'implementation':<22} {'gen tokens':>10} {'time (s)':>9} {'tok/s':>8}")
        print(f"  {'grpo eval (candle)':<22} {o['generated_tokens']:>10d} {o['duration_s']:>9.2f} {o['tokens_per_sec']:>8.1f}")
        print(f"  {'transformers generate':<22} {h['generated_tokens']:>10d} {h['duration_s']:>9.2f} {h['tokens_per_sec']:>8.1f}")
        print(f"  ratio ours/HF = {r['ratio_ours_over_hf']:.2f}x")
        seq_sum = sum(x or 0 for x in o["per_sequence"])
        if seq_sum != o["generated_tokens"]:
            print(f"  note: ours report.json generated_tokens {o['generated_tokens']} != sum of its per-sample tokens {seq_sum} "
                  f"(the report counts each stop token); with {seq_sum}: ours {seq_sum / o['duration_s']:.1f} tok/s, "
                  f"ratio {seq_sum / o['duration_s'] / h['tokens_per_sec']:.2f}x")
        if o["prompt_tokens"] != h["prompt_tokens"]:
            print(f"  note: prompt token counts differ: ours {o['prompt_tokens']}, HF {h['prompt_tokens']}")
        if o["per_sequence"] != h["per_sequence"]:
            print(f"  note: generated tokens per sequence differ (greedy paths diverge):")
            print(f"    ours {o['per_sequence']}")
            print(f"    HF   {h['per_sequence']}")
        print()
    with open(out_json, "w") as f:
        json.dump({"date": date, "device": device, "model": "SmolLM2-135M-Instruct", "dtype": "f32", "results": rows}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "prep":
        prep(args[0], args[1], int(args[2]))
    elif cmd == "hf":
        hf(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif cmd == "report":
        report(*args)
    else:
        sys.exit(f"unknown command {cmd}")
