#!/usr/bin/env python3
"""An independent float64 numpy implementation of every objective of src/objective (advantages, inclusion,
aggregation weights, loss, its parts and d loss / d log pi per token), run on random cases, written as the
fixture that src/objective/tests_fixture.rs compares the Rust objectives against.

    python3 scripts/objectives_reference.py tests/fixtures/objectives/cases.json

The formulas follow the doc comments of src/objective/{clipped,reinforce,oapl}.rs (seed 000, 003, 004).
Gradients are written out analytically and checked here against central finite differences away from the
mask and clamp boundaries; random draws that fall within a small margin of a boundary (where float32 and
float64 may disagree on which side a value lies) are redrawn.
"""
import json
import sys

import numpy as np

MAX_LOG_RATIO = 20.0
M64 = (1 << 64) - 1


class NearBoundary(Exception):
    pass


def near(x, bound, margin):
    if np.any(np.abs(np.asarray(x, dtype=np.float64) - bound) < margin):
        raise NearBoundary()


# ---- options with their per-objective defaults (src/objective/config.rs) ----

def opt(cfg, key):
    name = cfg["name"]
    if key in cfg:
        return cfg[key]
    if key == "eps":
        return 6e-4 if name == "gspo" else 0.2
    if key == "eps_high":
        return 8e-4 if (name == "gspo" and "eps" not in cfg) else opt(cfg, "eps")
    if key == "scale_rewards":
        if "std_normalize" in cfg:
            return "group" if cfg["std_normalize"] else "none"
        return "group" if name in ("off_grpo", "grpo", "cispo") else "none"
    if key == "clip_ratio_c":
        if cfg.get("dual_clip") is False:
            return None
        if "clip_ratio_c" in cfg:
            return cfg["clip_ratio_c"]
        return 3.0 if cfg.get("dual_clip") else None
    if key == "loss_agg":
        if name in ("off_grpo", "grpo", "gspo", "sft"):
            return "seq-mean-token-mean"
        return "seq-mean-token-sum" if name == "oapl" else "token-mean"
    defaults = {"bias": 0.0, "beta": 0.0, "kl_estimator": "k3", "clip_mode": "one-side",
                "importance_weight": False, "eps_low_outer": 0.6, "eps_high_outer": 2.0, "tau": 0.1,
                "baseline_shift": 0.1, "temperature": 1.0, "beta1": 1.0, "beta2": 1e-3, "mask_truncated": False,
                "ratio_level": "sequence" if name == "gspo" else "token"}
    return defaults[key]


# ---- advantages ----

def centred(r, scale, batch_std):
    """r - mean(r), divided by the group's std (scale "group"), by `batch_std` ("batch") or not ("none")."""
    r = np.asarray(r, dtype=np.float64)
    mean = r.mean()
    std = r.std(ddof=1) if len(r) > 1 else 0.0
    a = r - mean
    if scale == "group":
        return a / (std + 1e-6)
    if scale == "batch":
        return a / (batch_std + 1e-6)
    return a


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fnv1a(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def draw(seed, question, epoch, j):
    k = splitmix64(splitmix64(splitmix64(seed) ^ fnv1a(question)) ^ epoch)
    return splitmix64(k ^ j)


def group_advantages(cfg, rewards, seed, epoch, question, batch_std):
    """Per answer: advantage and whether it is in the loss (`batch_std`: the std of all the batch's
    rewards)."""
    name = cfg["name"]
    r = np.asarray(rewards, dtype=np.float64)
    include = np.ones(len(r), dtype=bool)
    scale = opt(cfg, "scale_rewards")
    if name in ("off_grpo", "grpo", "gspo", "rec", "cispo"):
        a = centred(r, scale, batch_std)
        if np.all(r > 0) and opt(cfg, "bias") != 0:
            a = a + opt(cfg, "bias")
    elif name == "opmd":
        a = centred(r, scale, batch_std)
    elif name == "asymre":
        a = r - r.mean() + opt(cfg, "baseline_shift")
    elif name == "red_weight":
        a = centred(r, scale, batch_std)
        a = np.exp(np.clip(a / opt(cfg, "temperature"), -MAX_LOG_RATIO, MAX_LOG_RATIO)) * a
    elif name == "red_drop":
        mean = r.mean()
        pos = int(np.sum(r > mean))
        neg = [j for j in range(len(r)) if r[j] < mean]
        excess = max(0, len(neg) - pos)
        for j in sorted(neg, key=lambda j: (draw(seed, question, epoch, j), j))[:excess]:
            include[j] = False
        a = np.zeros(len(r))
        a[include] = centred(r[include], scale, batch_std)
    elif name == "oapl":
        b1 = opt(cfg, "beta1")
        s = r / b1
        v = b1 * (s.max() + np.log(np.mean(np.exp(s - s.max()))))
        a = r - v
    elif name == "sft":
        include = np.ones(len(r), dtype=bool) if cfg.get("sft_answers") == "all" else r > 0
        a = include.astype(np.float64)
    else:
        raise ValueError(name)
    return a, include


def agg_weights(mode, lengths, include, norm_len):
    lengths = np.asarray(lengths)
    n_seq = max(int(include.sum()), 1)
    n_tok = max(int(lengths[include].sum()), 1)
    w = np.zeros(len(lengths))
    for i, (l, inc) in enumerate(zip(lengths, include)):
        if not inc or l == 0:
            continue
        w[i] = {"token-mean": 1.0 / n_tok, "seq-mean-token-mean": 1.0 / (n_seq * l),
                "seq-mean-token-sum": 1.0 / n_seq, "seq-mean-token-sum-norm": 1.0 / (n_seq * norm_len)}[mode]
    return w


# ---- per-token pieces ----

def kl_terms(est, logp, ref):
    """KL_t and d KL_t / d logp."""
    if est == "k1":
        return logp - ref, np.ones_like(logp)
    if est == "k2":
        return 0.5 * (logp - ref) ** 2, logp - ref
    d = ref - logp
    near(np.abs(d), MAX_LOG_RATIO, 1e-3)
    inside_exp = np.abs(d) <= MAX_LOG_RATIO
    e = np.exp(np.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    k3 = e - d - 1.0
    near(np.abs(k3), 10.0, 1e-3)
    inside = np.abs(k3) <= 10.0
    value = np.where(inside, k3, np.clip(k3, -10.0, 10.0))
    grad = np.where(inside, 1.0 - e * inside_exp, 0.0)
    return value, grad


def ratios(cfg, logp, behaviour, seq):
    """Per token: r_t (token ratio or the sequence's s_i) and d r_t / d logp_t."""
    rho = logp - behaviour
    if opt(cfg, "ratio_level") == "sequence":
        means = np.array([rho[seq == i].mean() for i in range(seq.max() + 1)])
        rho = means[seq]
    near(np.abs(rho), MAX_LOG_RATIO, 1e-3)
    inside = np.abs(rho) <= MAX_LOG_RATIO
    r = np.exp(np.clip(rho, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return r, r * inside


def clipped_family(cfg, logp, behaviour, seq, adv, stopped):
    """Per-token policy loss, its gradient and the clipped count (off_grpo, grpo, gspo, rec, cispo).
    `stopped`: the log-probs that cispo's gradient-stopped weight is computed from."""
    el, eh = opt(cfg, "eps"), opt(cfg, "eps_high")
    r, dr = ratios(cfg, logp, behaviour, seq)
    margin = 1e-4
    for b in (1 - el, 1 + eh):
        near(r, b, margin * b)
    if cfg["name"] == "cispo":
        # -sg(clip(r)) A log pi: the weight is a constant, every token keeps its gradient.
        w = np.clip(ratios(cfg, stopped, behaviour, seq)[0], 1 - el, 1 + eh)
        return -w * adv * logp, -w * adv, int(np.sum((r < 1 - el) | (r > 1 + eh)))
    if cfg["name"] != "rec":
        clip_r = np.clip(r, 1 - el, 1 + eh)
        use_clipped = clip_r * adv < r * adv
        value = -np.where(use_clipped, clip_r * adv, r * adv)
        grad = -np.where(use_clipped, 0.0, adv * dr)
        c = opt(cfg, "clip_ratio_c")
        if c is None:
            return value, grad, int(use_clipped.sum())
        # Dual-clip (verl): for A < 0 the loss is min(-c A, PPO's); the constant has no gradient.
        near(r, c, margin * c)
        dual = (adv < 0) & (value > -c * adv)
        value = np.where(dual, -c * adv, value)
        grad = np.where(dual, 0.0, grad)
        return value, grad, int(use_clipped.sum() + dual.sum())
    mode = opt(cfg, "clip_mode")
    pos, neg = adv > 0, adv < 0
    band = (r >= 1 - el) & (r <= 1 + eh)
    if mode == "one-side":
        m = (pos & (r <= 1 + eh)) | (neg & (r >= 1 - el))
    elif mode == "two-side":
        m = band
    else:
        elo, eho = opt(cfg, "eps_low_outer"), opt(cfg, "eps_high_outer")
        for b in (1 - elo, 1 + eho):
            near(r, b, margin * b)
        m = band | (pos & (r <= 1 - elo)) | (neg & (r >= 1 + eho))
    m = m.astype(np.float64)
    clipped = int(np.sum((m == 0) & (adv != 0)))
    if opt(cfg, "importance_weight"):
        return -adv * m * r, -adv * m * dr, clipped
    return -adv * m * logp, -adv * m, clipped


def seq_sums(x, seq):
    return np.array([x[seq == i].sum() for i in range(seq.max() + 1)])


def loss_and_grad(cfg, logp, behaviour, ref, seq, adv_t, w_t, w_seq, stopped=None):
    """(loss, pg_loss, kl, clipped, d loss / d logp) of one batch of whole sequences. `stopped`: the
    log-probs behind gradient-stopped factors (cispo's weight), default `logp`."""
    name = cfg["name"]
    beta = opt(cfg, "beta")
    clipped = 0
    if name in ("off_grpo", "grpo", "gspo", "rec", "cispo"):
        stopped = logp if stopped is None else stopped
        value, g, clipped = clipped_family(cfg, logp, behaviour, seq, adv_t, stopped)
        pg, grad = np.sum(w_t * value), w_t * g
    elif name in ("asymre", "red_drop", "red_weight", "sft"):
        pg, grad = np.sum(-w_t * adv_t * logp), -w_t * adv_t
    elif name == "opmd":
        s = seq_sums(logp - behaviour, seq)
        tau = opt(cfg, "tau")
        pg = np.sum(-w_t * adv_t * logp) + np.sum(w_seq * tau / 2 * s ** 2)
        grad = -w_t * adv_t + (w_seq * tau * s)[seq]
    elif name == "oapl":
        s = seq_sums(logp - behaviour, seq)
        b2 = opt(cfg, "beta2")
        target = np.array([adv_t[seq == i][0] for i in range(seq.max() + 1)])
        res = b2 * s - target
        pg = np.sum(w_seq * res ** 2)
        grad = (2 * w_seq * b2 * res)[seq]
    else:
        raise ValueError(name)
    kl = 0.0
    loss = pg
    if beta > 0 and name != "oapl":
        k, dk = kl_terms(opt(cfg, "kl_estimator"), logp, ref)
        kl = np.sum(w_t * k)
        loss = pg + beta * kl
        grad = grad + beta * w_t * dk
    return loss, pg, kl, clipped, grad


def check_gradient(cfg, logp, behaviour, ref, seq, adv_t, w_t, w_seq, grad):
    """Central finite differences of the loss with the behaviour log-probs held fixed (a step anchor is a
    detached copy) and gradient-stopped factors held at their value (cispo's weight). Masks are piecewise
    constant, and a sequence ratio's token form has the exact gradient because a sequence's tokens share
    one weight."""
    h = 1e-6
    base = loss_and_grad(cfg, logp, behaviour, ref, seq, adv_t, w_t, w_seq)[0]
    if abs(base) > 1e3:
        return  # a clamped ratio of e^20 in the value: differences of 1e-6 drown in its rounding
    for t in range(len(logp)):
        up, down = logp.copy(), logp.copy()
        up[t] += h
        down[t] -= h
        try:
            lu = loss_and_grad(cfg, up, behaviour, ref, seq, adv_t, w_t, w_seq, stopped=logp)[0]
            ld = loss_and_grad(cfg, down, behaviour, ref, seq, adv_t, w_t, w_seq, stopped=logp)[0]
        except NearBoundary:
            continue
        fd = (lu - ld) / (2 * h)
        assert abs(fd - grad[t]) < 1e-5 * max(1.0, abs(fd)), (cfg, t, fd, grad[t])


def make_rewards(rng, group_size, few_positives):
    if few_positives:  # more negatives than positives: RED-Drop's case
        rewards = np.zeros(group_size)
        rewards[rng.choice(group_size, size=rng.integers(1, group_size // 2), replace=False)] = 1.0
        return rewards
    kind = rng.integers(0, 4)
    if kind == 0:
        return np.ones(group_size)  # all positive: the bias case
    if kind == 1:
        return rng.choice([0.0, 0.5, 1.0], size=group_size)
    return (rng.random(group_size) < rng.choice([0.2, 0.5])).astype(np.float64)


def make_case(rng, name, cfg, behaviour_kind, n_groups=3, group_size=5, seed=0, epoch=0, big_gap=False,
              few_positives=False):
    """A random case: groups of rewards and lengths, log-probs, behaviour and reference log-probs. At
    least two groups have rewards that differ (non-zero advantages)."""
    while True:
        groups = []
        for g in range(n_groups):
            rewards = make_rewards(rng, group_size, few_positives)
            lengths = rng.integers(1, 7, size=group_size)
            groups.append({"question": f"q{rng.integers(0, 1 << 30)}", "rewards": rewards.tolist(),
                           "lengths": lengths.tolist(), "truncated": (rng.random(group_size) < 0.25).tolist()})
        if sum(len(set(g["rewards"])) > 1 for g in groups) < 2:
            continue
        n = sum(sum(g["lengths"]) for g in groups)
        logp = -rng.exponential(1.2, size=n) - 0.01
        if behaviour_kind == "none":
            behaviour = None
        elif behaviour_kind == "step":
            behaviour = logp.copy()
        elif behaviour_kind == "tiny":
            behaviour = logp + rng.normal(0, 1.5e-3, size=n)
        elif behaviour_kind == "wide":  # ratios from about 0.2 to 5: every clip and dual-clip branch
            behaviour = logp + rng.normal(0, 0.9, size=n)
        else:
            behaviour = logp + rng.normal(0, 0.4, size=n)
        if big_gap:
            behaviour = np.where(rng.random(n) < 0.5, logp - 40.0, logp + rng.normal(0, 0.4, size=n))
        ref = logp + rng.normal(0, 0.5, size=n)
        case = {"name": name, "objective": cfg, "seed": seed, "epoch": epoch, "norm_len": 8, "groups": groups,
                "logp": logp.tolist(), "behaviour": None if behaviour is None else behaviour.tolist(),
                "ref": ref.tolist()}
        try:
            case["expected"] = expected(case)
            return case
        except NearBoundary:
            continue


def expected(case):
    cfg = case["objective"]
    advs, incs, lengths = [], [], []
    batch_std = np.std(np.concatenate([g["rewards"] for g in case["groups"]]), ddof=1)
    for g in case["groups"]:
        a, inc = group_advantages(cfg, g["rewards"], case["seed"], case["epoch"], g["question"], batch_std)
        if opt(cfg, "mask_truncated"):  # cut answers leave the loss, after their group's advantages
            inc = inc & ~np.array(g["truncated"])
        advs.extend(a.tolist())
        incs.extend(inc.tolist())
        lengths.extend(g["lengths"])
    include = np.array(incs)
    norm_len = cfg.get("loss_scale_factor", case["norm_len"])
    w = agg_weights(opt(cfg, "loss_agg"), lengths, include, norm_len)
    logp_all = np.array(case["logp"])
    beh_all = np.zeros_like(logp_all) if case["behaviour"] is None else np.array(case["behaviour"])
    ref_all = np.array(case["ref"])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tok = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in range(len(lengths)) if include[i]])
    kept = [i for i in range(len(lengths)) if include[i]]
    seq = np.concatenate([np.full(lengths[i], k) for k, i in enumerate(kept)])
    adv_t = np.array([advs[i] for i in kept])[seq]
    w_seq = np.array([w[i] for i in kept])
    w_t = w_seq[seq]
    logp, beh, ref = logp_all[tok], beh_all[tok], ref_all[tok]
    loss, pg, kl, clipped, grad = loss_and_grad(cfg, logp, beh, ref, seq, adv_t, w_t, w_seq)
    check_gradient(cfg, logp, beh, ref, seq, adv_t, w_t, w_seq, grad)
    grad_all = np.zeros_like(logp_all)
    grad_all[tok] = grad
    return {"advantages": advs, "include": incs, "weights": w.tolist(), "loss": float(loss),
            "pg_loss": float(pg), "kl": float(kl), "clipped": clipped, "grad": grad_all.tolist()}


CASES = [
    # (name, objective options, behaviour: none = teacher probability 1 | step | near | tiny, extra)
    ("off_grpo seed: b 0.5, beta 0.1 k3, teacher probability 1", {"name": "off_grpo", "bias": 0.5, "beta": 0.1}, "none", {}),
    ("off_grpo teacher log-probs, eps 0.2/0.28, k2, seq-mean-token-sum",
     {"name": "off_grpo", "eps": 0.2, "eps_high": 0.28, "beta": 0.05, "kl_estimator": "k2",
      "loss_agg": "seq-mean-token-sum"}, "near", {}),
    ("grpo step anchor, k1, token-mean", {"name": "grpo", "beta": 0.1, "kl_estimator": "k1", "loss_agg": "token-mean"},
     "step", {}),
    ("grpo eps 0.1 eps_high 0.3, no std, sum-norm",
     {"name": "grpo", "eps": 0.1, "eps_high": 0.3, "std_normalize": False, "bias": 0.25,
      "loss_agg": "seq-mean-token-sum-norm", "anchor": "reference"}, "near", {}),
    ("gspo seed 004 B.7 eps 6e-4/8e-4", {"name": "gspo", "anchor": "snapshot"}, "tiny", {}),
    ("gspo eps 0.2, std, k3", {"name": "gspo", "eps": 0.2, "std_normalize": True, "beta": 0.1}, "near", {}),
    ("rec one-side NOIS 0.6/2.0", {"name": "rec", "eps": 0.6, "eps_high": 2.0}, "near", {}),
    ("rec one-side IS", {"name": "rec", "importance_weight": True}, "near", {}),
    ("rec two-side NOIS", {"name": "rec", "clip_mode": "two-side"}, "near", {}),
    ("rec two-side IS, k3", {"name": "rec", "clip_mode": "two-side", "importance_weight": True, "beta": 0.1},
     "near", {}),
    ("rec ring NOIS 0.2/0.2 outer 0.6/2.0", {"name": "rec", "clip_mode": "ring"}, "near", {}),
    ("rec ring IS outer 0.3/0.25", {"name": "rec", "clip_mode": "ring", "importance_weight": True,
                                    "eps_low_outer": 0.3, "eps_high_outer": 0.25}, "near", {}),
    ("rec sequence-level NOIS", {"name": "rec", "ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"},
     "near", {}),
    ("opmd tau 0.1 snapshot", {"name": "opmd", "anchor": "snapshot"}, "near", {}),
    ("opmd tau 0.5 std, seq-mean-token-sum, k2",
     {"name": "opmd", "tau": 0.5, "std_normalize": True, "loss_agg": "seq-mean-token-sum", "beta": 0.2,
      "kl_estimator": "k2", "anchor": "teacher"}, "none", {}),
    ("opmd step anchor", {"name": "opmd"}, "step", {}),
    ("asymre shift 0.1", {"name": "asymre"}, "none", {}),
    ("asymre shift 0.3, k3", {"name": "asymre", "baseline_shift": 0.3, "beta": 0.1}, "none", {}),
    ("red_drop", {"name": "red_drop"}, "none", {"group_size": 7, "seed": 11, "epoch": 2, "few_positives": True}),
    ("red_drop std, seq-mean-token-mean", {"name": "red_drop", "std_normalize": True,
                                           "loss_agg": "seq-mean-token-mean"}, "none",
     {"group_size": 8, "seed": 5, "epoch": 0, "few_positives": True}),
    ("red_weight T 1", {"name": "red_weight"}, "none", {}),
    ("red_weight T 0.5 std", {"name": "red_weight", "temperature": 0.5, "std_normalize": True}, "none", {}),
    ("oapl seed 003 snapshot, beta2 1e-3", {"name": "oapl"}, "near", {}),
    ("oapl beta1 0.5 beta2 0.05, teacher probability 1",
     {"name": "oapl", "beta1": 0.5, "beta2": 0.05, "anchor": "teacher"}, "none", {}),
    ("sft k3", {"name": "sft", "beta": 0.1}, "none", {}),
    # Options named after TRL's and verl's.
    ("grpo dual-clip c 3 (verl), ratios far from 1", {"name": "grpo", "dual_clip": True, "anchor": "teacher"},
     "wide", {}),
    ("off_grpo dual-clip c 1.5, k3", {"name": "off_grpo", "clip_ratio_c": 1.5, "beta": 0.1}, "wide", {}),
    ("gspo dual-clip c 1.2, eps 0.2", {"name": "gspo", "eps": 0.2, "clip_ratio_c": 1.2}, "wide", {}),
    ("cispo eps 0.2 (verl), teacher log-probs", {"name": "cispo", "anchor": "teacher"}, "wide", {}),
    ("cispo MiniMax eps 1.0 high 0.28 batch scale, k2",
     {"name": "cispo", "eps": 0.99, "eps_high": 0.28, "scale_rewards": "batch", "beta": 0.1, "kl_estimator": "k2",
      "anchor": "teacher"}, "wide", {}),
    ("cispo step anchor: plain REINFORCE", {"name": "cispo"}, "step", {}),
    ("grpo scale_rewards batch", {"name": "grpo", "scale_rewards": "batch", "anchor": "teacher"}, "near", {}),
    ("grpo scale_rewards none", {"name": "grpo", "scale_rewards": "none", "anchor": "teacher"}, "near", {}),
    ("rec scale_rewards group", {"name": "rec", "scale_rewards": "group"}, "near", {}),
    ("red_weight scale_rewards batch", {"name": "red_weight", "scale_rewards": "batch"}, "none", {}),
    ("red_drop scale_rewards batch", {"name": "red_drop", "scale_rewards": "batch"}, "none",
     {"group_size": 7, "seed": 3, "epoch": 1, "few_positives": True}),
    ("opmd scale_rewards batch", {"name": "opmd", "scale_rewards": "batch", "anchor": "snapshot"}, "near", {}),
    ("dr_grpo: sum-norm with loss_scale_factor 5",
     {"name": "grpo", "loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 5, "scale_rewards": "none",
      "anchor": "teacher"}, "near", {}),
    ("mask_truncated grpo token-mean (dapo)",
     {"name": "grpo", "mask_truncated": True, "loss_agg": "token-mean", "beta": 0.1, "anchor": "teacher"}, "near", {}),
    ("mask_truncated off_grpo seq-mean-token-mean", {"name": "off_grpo", "mask_truncated": True}, "none", {}),
    ("mask_truncated sft all", {"name": "sft", "mask_truncated": True, "sft_answers": "all"}, "none", {}),
    ("clamp: off_grpo teacher log-prob 40 below", {"name": "off_grpo", "beta": 0.1}, "near", {"big_gap": True}),
    ("clamp: rec IS ring, huge ratios", {"name": "rec", "clip_mode": "ring", "importance_weight": True},
     "near", {"big_gap": True}),
    ("clamp: gspo, huge ratios", {"name": "gspo", "eps": 0.2}, "near", {"big_gap": True}),
]


def main(out):
    rng = np.random.default_rng(20240613)
    cases = []
    for name, cfg, beh, extra in CASES:
        for rep in range(2):
            cases.append(make_case(rng, f"{name} #{rep}", cfg, beh, **extra))
    with open(out, "w") as f:
        json.dump({"generator": "scripts/objectives_reference.py", "cases": cases}, f, indent=None)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/objectives/cases.json")
