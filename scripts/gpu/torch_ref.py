"""PyTorch eager reference for the grpo benchmarks (run on the GPU machine, no network needed).

Usage:
  python scripts/gpu/torch_ref.py train-step --shape scripts/gpu/shapes/qwen2.5-0.5b.json \
      --answers 8 --seq-len 1024 --prompt-len 128 --steps 3 --warmup 1 --device cuda --dtype bf16
  python scripts/gpu/torch_ref.py logprob --tokens 8192 --hidden 896 --vocab 151936 \
      --dtype bf16 --device cuda --repeats 5 [--with-loss]
  python scripts/gpu/torch_ref.py generate --shape scripts/gpu/shapes/qwen2.5-0.5b.json \
      --batch 1 --prompt-len 128 --new-tokens 256 --device cuda --dtype bf16 --repeats 2

Each measurement is printed as one JSON line on stdout (logs go to stderr); report.py merges
these lines with the ones of `grpo bench`. Models are Qwen2 models with random weights built
from an HF config.json (seeded), written the way people usually write a GRPO step in eager
PyTorch: full logits, log_softmax in f32, one answer per micro-batch, AdamW on f32 weights.

Units: times in seconds, memory in bytes, throughput in tokens per second.
"""

import argparse
import copy
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
LR = 1e-6  # AdamW learning rate
EPS = 0.2  # clip range of the ratio
BETA = 0.1  # weight of the k3 KL to the reference


def log(msg):
    print(f"[torch_ref] {msg}", file=sys.stderr, flush=True)


def emit(record):
    print(json.dumps(record), flush=True)


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    """Wall time of fn() in seconds, with the device synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


def build_model(shape, dtype, device):
    cfg = transformers.Qwen2Config.from_json_file(shape)
    # No pad token: the embedding is built without padding_idx, whose row transformers would zero at
    # init and whose gradient it would drop; grpo trains every row, so both compute the same step.
    cfg.pad_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    assert model.get_input_embeddings().padding_idx is None, "the embedding still has a padding_idx"
    return model.to(device)


def off_grpo_per_token(logp, ref_logp, adv):
    """The off_grpo per-token loss: clipped surrogate with behaviour log-prob 0, plus beta * k3 KL."""
    ratio = torch.exp(logp - 0.0)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    return pg + BETA * kl


def token_logp(model, ids):
    """Log-probs [T-1] of tokens 1..T-1 of the single sequence ids [1, T], from the full logits."""
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    return logits.float().log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def kernel_group(name):
    """The part of a step a CUDA kernel belongs to, by its name: attention (SDPA's flash, memory-efficient
    or cuDNN kernels), GEMM (cuBLAS, CUTLASS, nvjet) or other (element-wise, reductions, copies)."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "mha", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")):
        return "gemm"
    return "other"


def kernel_profile(step, device, top=12):
    """One more step under torch.profiler: the CUDA kernels' self time by group (kernel_group) and the
    longest kernels, in ms (a dict for the step's JSON record)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    groups, kernels = {"attention": 0.0, "gemm": 0.0, "other": 0.0}, []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        groups[kernel_group(e.key)] += us / 1e3
        kernels.append((e.key[:90], us / 1e3, e.count))
    kernels.sort(key=lambda k: -k[1])
    out = {f"{g}_ms": round(ms, 3) for g, ms in groups.items()}
    out["top"] = [[name, round(ms, 3), count] for name, ms, count in kernels[:top]]
    log("profiled step: " + ", ".join(f"{g} {ms:.1f} ms" for g, ms in groups.items()))
    for name, ms, count in kernels[:top]:
        log(f"  {ms:9.2f} ms {count:6d}x  {name}")
    return out


def train_run(args, grad_ckpt):
    """Runs warmup + steps training steps, then with --profile one more under the profiler; returns (step
    times of the timed steps, losses, peak, the profile or None)."""
    device = torch.device(args.device)
    model = build_model(args.shape, torch.float32, device)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    if grad_ckpt:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen)
    responses = torch.randint(0, vocab, (args.answers, args.seq_len - args.prompt_len), generator=gen)
    ids = torch.cat([prompt.expand(args.answers, -1), responses], dim=1).to(device)
    # Position i of the shifted logits predicts token i + 1: the response starts at prompt_len - 1.
    mask = torch.zeros(args.seq_len - 1, device=device)
    mask[args.prompt_len - 1 :] = 1.0
    rewards = torch.tensor([1.0 if i % 2 == 0 else 0.0 for i in range(args.answers)])
    advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step():
        total = torch.zeros((), device=device)
        for i in range(args.answers):
            x = ids[i : i + 1]
            with torch.no_grad(), autocast():
                ref_logp = token_logp(ref, x)
            with autocast():
                logp = token_logp(model, x)
            per_token = off_grpo_per_token(logp, ref_logp, advantages[i])
            # Token mean within the answer, mean over answers: the accumulated loss is the batch loss.
            loss = (per_token * mask).sum() / mask.sum() / args.answers
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()

    times, losses = [], []
    for s in range(args.warmup + args.steps):
        if s == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dt, loss = timed(device, step)
        losses.append(loss)
        if s >= args.warmup:
            times.append(dt)
        log(f"step {s} ({'timed' if s >= args.warmup else 'warm-up'}): {dt:.3f} s, loss {loss:.6f}")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    profiled = None
    if args.profile:
        try:
            profiled = kernel_profile(step, device)
        except Exception as e:  # the timings stand without it
            log(f"profiling failed: {e!r}")
    return times, losses, peak, profiled


def train_step(args):
    if not 1 <= args.prompt_len < args.seq_len:
        sys.exit("need 1 <= prompt-len < seq-len")
    if args.answers < 2 or args.steps < 1:
        sys.exit("need answers >= 2 (for the advantage std) and steps >= 1")
    oom = False
    try:
        times, losses, peak, profiled = train_run(args, grad_ckpt=False)
    except torch.cuda.OutOfMemoryError:
        oom = True
    if oom:  # outside the except block, so the frames holding the first model are released
        log("out of memory without gradient checkpointing; retrying with it")
        gc.collect()
        torch.cuda.empty_cache()
        times, losses, peak, profiled = train_run(args, grad_ckpt=True)
    step_time = statistics.median(times)
    tokens = args.answers * args.seq_len
    emit({
        "bench": "train_step", "impl": "torch", "shape": Path(args.shape).stem,
        "answers": args.answers, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
        "dtype": args.dtype, "device": device_name(torch.device(args.device)), "micro_batch": 1,
        "grad_ckpt": oom, "oom_without_ckpt": oom,
        "step_times": times, "step_time_s": step_time, "tokens": tokens,
        "response_tokens": args.answers * (args.seq_len - args.prompt_len),
        "tokens_per_s": tokens / step_time, "peak_mem_bytes": peak, "losses": losses,
        "torch": torch.__version__, "transformers": transformers.__version__,
        **({"kernel_profile": profiled} if profiled else {}),
    })


def logprob(args):
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    n, vocab = args.tokens, args.vocab
    torch.manual_seed(0)
    hidden = torch.randn(n, args.hidden, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, args.hidden, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    g = torch.randn(n, device=device)
    ref_logp = torch.randn(n, device=device) * 0.1 - math.log(vocab)
    adv = torch.randn(n, device=device)

    def forward():
        logits = hidden @ weight.T
        logp = logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        if args.with_loss:
            return off_grpo_per_token(logp, ref_logp, adv).mean()
        return (logp * g).sum()

    def forward_backward():
        hidden.grad = weight.grad = None
        forward().backward()

    def median_time(fn):
        fn()  # warm-up
        return statistics.median(timed(device, fn)[0] for _ in range(args.repeats))

    fwd = median_time(forward)  # with autograd recording, as in training
    fwd_bwd = median_time(forward_backward)
    peak = None
    if device.type == "cuda":
        hidden.grad = weight.grad = None
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward_backward()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    emit({
        "bench": "logprob", "impl": "torch_naive", "tokens": n, "hidden": args.hidden,
        "vocab": vocab, "dtype": args.dtype, "device": device_name(device),
        "with_loss": args.with_loss, "fwd_time_s": fwd, "fwd_bwd_time_s": fwd_bwd,
        "peak_mem_bytes": peak,
    })


def generate(args):
    device = torch.device(args.device)
    model = build_model(args.shape, DTYPES[args.dtype], device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    ids = ids.to(device)
    attention_mask = torch.ones_like(ids)

    def run():
        # min_new_tokens = max_new_tokens: EOS is masked out, so every row gets exactly N tokens.
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=attention_mask, max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
            )
        assert out.shape == (args.batch, args.prompt_len + args.new_tokens), out.shape

    run()  # warm-up
    times = [timed(device, run)[0] for _ in range(args.repeats)]
    log(f"generate times: {times}")
    t = statistics.median(times)
    emit({
        "bench": "generate", "impl": "torch", "shape": Path(args.shape).stem, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype,
        "device": device_name(device), "time_s": t, "tokens_per_s": args.batch * args.new_tokens / t,
    })


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s, dtype):
        s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        s.add_argument("--dtype", default=dtype, choices=list(DTYPES))

    t = sub.add_parser("train-step", help="one off-policy GRPO training step (policy + reference)")
    t.add_argument("--shape", required=True, help="HF config.json of a Qwen2 model")
    t.add_argument("--answers", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--prompt-len", type=int, default=128)
    t.add_argument("--steps", type=int, default=3, help="timed steps")
    t.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    t.add_argument("--profile", action="store_true",
                   help="then one more step under torch.profiler: CUDA time in attention, GEMMs and the rest")
    common(t, "bf16")
    t.set_defaults(fn=train_step)

    lp = sub.add_parser("logprob", help="naive per-token log-prob of the lm_head")
    lp.add_argument("--tokens", type=int, default=8192)
    lp.add_argument("--hidden", type=int, default=896)
    lp.add_argument("--vocab", type=int, default=151936)
    lp.add_argument("--repeats", type=int, default=5)
    lp.add_argument("--with-loss", action="store_true", help="the off_grpo loss instead of a dot product")
    common(lp, "bf16")
    lp.set_defaults(fn=logprob)

    g = sub.add_parser("generate", help="greedy generation with model.generate")
    g.add_argument("--shape", required=True, help="HF config.json of a Qwen2 model")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--repeats", type=int, default=2)
    common(g, "bf16")
    g.set_defaults(fn=generate)

    args = p.parse_args()
    log(f"torch {torch.__version__}, transformers {transformers.__version__}: {vars(args)}")
    args.fn(args)


if __name__ == "__main__":
    main()
