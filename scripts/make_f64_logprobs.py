#!/usr/bin/env python3
"""Float64 reference log-probs of a Llama-architecture model (SmolLM2-135M), committed as a test fixture.

    scripts/make-smollm2.sh
    python3 scripts/make_f64_logprobs.py --model tests/fixtures/models/smollm2-135m \
        --check tests/fixtures/parity/smollm2.json --out tests/fixtures/parity/smollm2-f64.json

An independent numpy implementation of transformers' LlamaForCausalLM forward, every operation in float64:
RMSNorm, rotary embeddings (rotate-half layout, base and Llama-3 / linear scaling from config.json in either
the transformers 4 layout, top-level `rope_theta` / `rope_scaling`, or the transformers 5 layout,
`rope_parameters`), grouped-query causal attention, SiLU MLP, tied or untied lm_head, log-softmax. Weights
are read from model.safetensors with a small reader of its own (bf16, f16 and f32 tensors, no torch);
texts are encoded with the `tokenizers` library from tokenizer.json, special tokens included, as
`grpo logprobs` does for `{"text"}` lines.

--check compares with a fixture of scripts/make_parity_fixtures.py (transformers in float32): tokens must
be identical and the float32 log-probs close (their difference is transformers' float32 error, which is
recorded in the output as `f32_reference_max_error`).
Needs: numpy, tokenizers.
"""
import argparse, json, os, struct, sys

import numpy as np
from tokenizers import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Solve 2x + 3 = 11. Subtracting 3 gives 2x = 8, so x = 4. The answer is \\boxed{4}.",
    "Let $a_1 = 1$ and $a_{n+1} = 2a_n + 1$. Then $a_n = 2^n - 1$, which for n = 10 gives 1023. " * 3,
    "<|im_start|>user\nWhat is 7 times 6?<|im_end|>\n<|im_start|>assistant\n7 times 6 is 42.<|im_end|>\n",
]


def read_safetensors(path):
    """All tensors of a .safetensors file as float64 arrays."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[a:b]
        if meta["dtype"] == "BF16":
            x = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "F16":
            x = np.frombuffer(raw, dtype="<f2")
        elif meta["dtype"] == "F32":
            x = np.frombuffer(raw, dtype="<f4")
        else:
            raise SystemExit(f"{path}: {name} has dtype {meta['dtype']}")
        out[name] = x.astype(np.float64).reshape(meta["shape"])
    return out


def rope_settings(cfg):
    """(theta, scaling dict or None) from either config.json layout."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(theta), (None if kind == "default" else dict(scaling, rope_type=kind))


def inv_freq(cfg, head_dim):
    theta, scaling = rope_settings(cfg)
    f = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return f
    if scaling["rope_type"] == "linear":
        return f / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / f
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * f / factor + smooth * f
        return np.where(wavelen > old / lo, f / factor, np.where(wavelen < old / hi, f, mid))
    raise SystemExit(f"rope type {scaling['rope_type']} is not implemented here")


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def attention(x, W, p, cfg, cos, sin):
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    t = x.shape[0]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads

    def proj(name, n):
        y = x @ W[f"{p}.self_attn.{name}.weight"].T
        if f"{p}.self_attn.{name}.bias" in W:
            y = y + W[f"{p}.self_attn.{name}.bias"]
        return y.reshape(t, n, hd).transpose(1, 0, 2)

    q = rotate(proj("q_proj", heads), cos, sin)
    k = rotate(proj("k_proj", kv), cos, sin)
    v = proj("v_proj", kv)
    k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (s / s.sum(axis=-1, keepdims=True)) @ v
    return o.transpose(1, 0, 2).reshape(t, heads * hd) @ W[f"{p}.self_attn.o_proj.weight"].T


def logprobs(W, cfg, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, all in float64."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise SystemExit("only SiLU is implemented")
    eps = cfg.get("rms_norm_eps", 1e-6)
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    ang = np.arange(len(ids), dtype=np.float64)[:, None] * inv_freq(cfg, hd)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x = W["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = x + attention(rms_norm(x, W[f"{p}.input_layernorm.weight"], eps), W, p, cfg, cos, sin)
        h = rms_norm(x, W[f"{p}.post_attention_layernorm.weight"], eps)
        g, u = h @ W[f"{p}.mlp.gate_proj.weight"].T, h @ W[f"{p}.mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[f"{p}.mlp.down_proj.weight"].T
    h = rms_norm(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else W["lm_head.weight"]
    z = h @ head.T
    m = z.max(axis=-1, keepdims=True)
    lp = z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def check(W, cfg, tok, path):
    """Max |f64 - transformers f32| over the text cases of a parity fixture."""
    worst = 0.0
    for case in json.load(open(path))["cases"]:
        if "text" not in case:
            continue
        ids = tok.encode(case["text"], add_special_tokens=True).ids
        if ids != case["tokens"]:
            raise SystemExit(f"{path}: tokens differ for {case['text'][:40]!r}")
        ref = logprobs(W, cfg, ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, case["logprobs"])))
    print(f"transformers f32 ({path}) vs float64: max |diff| = {worst:.3g}")
    if worst > 1e-3:
        raise SystemExit("the float64 forward disagrees with transformers")
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", help="parity fixture made by transformers in f32")
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    W = read_safetensors(os.path.join(args.model, "model.safetensors"))
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    fixture = {"model": os.path.basename(os.path.normpath(args.model)), "dtype": "float64",
               "generator": "scripts/make_f64_logprobs.py", "cases": []}
    if args.check:
        fixture["f32_reference"] = os.path.basename(args.check)
        fixture["f32_reference_max_error"] = check(W, cfg, tok, args.check)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True).ids
        fixture["cases"].append({"text": text, "tokens": ids, "logprobs": logprobs(W, cfg, ids)})
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
    print(f"{args.out}: {sum(len(c['logprobs']) for c in fixture['cases'])} log-probs")


if __name__ == "__main__":
    sys.exit(main())
