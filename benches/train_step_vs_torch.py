"""Helper of benches/train_step_vs_torch.sh (needs torch + transformers + tokenizers).

The PyTorch side computes what grpo computes: token ids from the `tokenizers` library on tokenizer.json
(as grpo's tokenizer), not from transformers' tokenizer (transformers 5 drops SmolLM2's digit-splitting
pre-tokenizer, so numbers get other ids), and an embedding without padding_idx (transformers would zero
the gradient of the pad token's row, SmolLM2's <|im_end|>, which ends every answer; grpo computes it).

  prep  SRC OUT_JSONL N            first question of SRC (OT3 rows) with its first N answers -> OUT_JSONL
  torch ROWS MODEL MAX_RESP STEPS  one off_grpo training step of MODEL in PyTorch eager (f32, CPU), timed;
                                   prints a JSON line {"step_times": [...], "num_tokens": ..., ...}
  report OURS_METRICS TORCH_JSON OUT_JSON DEVICE DATE
                                   table of both + ratio ours/torch; writes OUT_JSON
"""
import json
import os
import statistics
import sys


def prep(src, out, n):
    rows = []
    for line in open(src):
        d = json.loads(line)
        if rows and d["conversations"][0]["value"] != rows[0]["conversations"][0]["value"]:
            break
        rows.append(d)
        if len(rows) == n:
            break
    if len(rows) < n:
        sys.exit(f"first question of {src} has only {len(rows)} answers, need {n}")
    with open(out, "w") as f:
        for d in rows:
            f.write(json.dumps(d) + "\n")


def build_batch(model_dir, rows_path, max_resp):
    """Token ids as grpo prepares them: chat-template prompt, response + <|im_end|>, truncated to max_resp.

    transformers only renders the chat template (text); the `tokenizers` library encodes it from
    tokenizer.json, with every pre-tokenizer rule, as grpo does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    if eos is None:
        sys.exit(f"{model_dir}/tokenizer.json has no <|im_end|> token")
    seqs = []
    for line in open(rows_path):
        d = json.loads(line)
        q = d["conversations"][0]["value"]
        a = d["conversations"][1]["value"]
        text = template.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=False)
        p = tok.encode(text, add_special_tokens=False).ids
        r = tok.encode(a, add_special_tokens=False).ids
        r = r[:max_resp] if len(r) >= max_resp else r + [eos]
        seqs.append((p, r))
    return seqs, eos


def torch_step(rows_path, model_dir, max_resp, steps):
    import copy
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    seqs, eos = build_batch(model_dir, rows_path, max_resp)
    num_tokens = sum(len(p) + len(r) for p, r in seqs)
    resp_tokens = sum(len(r) for _, r in seqs)
    T = max(len(p) + len(r) for p, r in seqs)
    B = len(seqs)
    pad = eos
    ids = torch.full((B, T), pad, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T - 1), dtype=torch.float32)  # over predicted positions 1..T-1
    for i, (p, r) in enumerate(seqs):
        s = p + r
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, len(p) - 1 : len(s) - 1] = 1.0
    targets = ids[:, 1:]
    adv = torch.full((B, 1), 0.5)
    eps, beta = 0.2, 0.1

    # No pad token in the config: transformers then builds the embedding without padding_idx, so the row
    # of <|im_end|> (SmolLM2's pad_token_id) gets its gradient, as in grpo.
    config = AutoConfig.from_pretrained(model_dir)
    config.pad_token_id = None
    policy = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                  attn_implementation="sdpa")
    assert policy.get_input_embeddings().padding_idx is None, "the embedding still has a padding_idx"
    policy.train()
    policy.config.use_cache = False
    reference = copy.deepcopy(policy).eval()
    for prm in reference.parameters():
        prm.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)

    def token_logp(model):
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def step():
        with torch.no_grad():
            ref_logp = token_logp(reference)
        logp = token_logp(policy)
        ratio = torch.exp(logp)  # behaviour probability 1
        pg = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        per_tok = pg + beta * k3
        loss = ((per_tok * mask).sum(-1) / mask.sum(-1)).mean()  # seq-mean-token-mean
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times = []
    losses = []
    for _ in range(1 + steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    print(json.dumps({
        "warmup_time": times[0],
        "step_times": times[1:],
        "num_tokens": num_tokens,
        "response_tokens": resp_tokens,
        "padded_shape": [B, T],
        "seq_lens": [[len(p), len(r)] for p, r in seqs],
        "losses": losses,
        "torch": torch.__version__,
    }))


def report(ours_metrics, torch_json, out_json, device, date):
    lines = [json.loads(l) for l in open(ours_metrics) if l.strip()]
    timed = lines[1:]  # step 1 warms up
    if not timed:
        sys.exit(f"{ours_metrics}: need at least 2 steps, got {len(lines)}")
    ours_t = statistics.median(x["step_time"] for x in timed)
    ours_tok = timed[0]["num_tokens"]
    th = json.loads(open(torch_json).read().strip().splitlines()[-1])
    th_t = statistics.median(th["step_times"])
    th_tok = th["num_tokens"]
    ours_tps = ours_tok / ours_t
    th_tps = th_tok / th_t
    ratio = ours_tps / th_tps
    print(f"{'implementation':<24} {'step time (s)':>13} {'tokens':>7} {'tokens/s':>9}")
    print(f"{'grpo (candle, f32)':<24} {ours_t:>13.3f} {ours_tok:>7d} {ours_tps:>9.1f}")
    print(f"{'pytorch eager (f32)':<24} {th_t:>13.3f} {th_tok:>7d} {th_tps:>9.1f}")
    print(f"ratio ours/torch = {ratio:.2f}x")
    print(f"num_tokens: ours {ours_tok}, torch {th_tok} -> {'match' if ours_tok == th_tok else 'MISMATCH'}")
    print(f"ours step times (s): {[round(x['step_time'], 3) for x in lines]} (first is warm-up)")
    print(f"torch step times (s): warm-up {th['warmup_time']:.3f}, timed {[round(x, 3) for x in th['step_times']]}")
    print(f"torch batch: padded {th['padded_shape']}, (prompt, response) lengths {th['seq_lens']}")
    print(f"loss: ours {[round(x['loss'], 5) for x in lines]}, torch {[round(x, 5) for x in th['losses']]}")
    res = {
        "date": date,
        "device": device,
        "model": "SmolLM2-135M-Instruct",
        "dtype": "f32",
        "ours": {"step_time_s": ours_t, "num_tokens": ours_tok, "tokens_per_sec": ours_tps,
                 "step_times": [x["step_time"] for x in lines], "losses": [x["loss"] for x in lines]},
        "torch": {"step_time_s": th_t, "num_tokens": th_tok, "tokens_per_sec": th_tps,
                  "warmup_time": th["warmup_time"], "step_times": th["step_times"],
                  "losses": th["losses"], "padded_shape": th["padded_shape"],
                  "seq_lens": th["seq_lens"], "version": th["torch"]},
        "tokens_match": ours_tok == th_tok,
        "ratio_ours_over_torch": ratio,
    }
    with open(out_json, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "prep":
        prep(args[0], args[1], int(args[2]))
    elif cmd == "torch":
        torch_step(args[0], args[1], int(args[2]), int(args[3]))
    elif cmd == "report":
        report(*args)
    else:
        sys.exit(f"unknown command {cmd}")
