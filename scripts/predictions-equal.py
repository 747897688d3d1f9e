"""Whether two grpo binaries predict alike: every committed H100 train step predicted as its build ran it,
a grid of this build's steps (`grpo bench train-step --predict-only`: the JSON compared whole), and every
shipped config's `train --plan` on each model shape, three device memories and one or four ranks (the text
compared). Prints one line per kind and exits 1 when anything differs.

    python3 scripts/predictions-equal.py BEFORE_GRPO AFTER_GRPO [--before-tags]

--before-tags: BEFORE names a measured build by its results' tag (`--measured-build 2026-11-27b`, the
binaries before the builds became files of benches/results/builds/); AFTER always by its file.
"""
import argparse
import glob
import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from calibrate import bench_args, build_file, file_tag  # noqa: E402


def run(grpo, args):
    p = subprocess.run([grpo, *args], capture_output=True, text=True, cwd=ROOT, env={"GRPO_CACHE_DIR": "off"})
    # A prediction that failed would compare equal to the other binary's failure: not a comparison.
    if args[0] == "bench" and p.returncode != 0:
        sys.exit(f"{grpo} {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout + p.stderr


def committed_steps():
    for f in sorted(glob.glob(str(ROOT / "benches/results/gpu-*-h100.jsonl"))):
        for line in Path(f).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("bench") == "train_step" and r.get("impl") == "grpo":
                yield r, file_tag(f)


def step_pairs(before_tags):
    """Each committed step's arguments for BEFORE and for AFTER (its build by tag or by file)."""
    for r, tag in committed_steps():
        args = ["bench", "train-step", "--predict-only", *bench_args(r, tag)]
        old = list(args)
        if before_tags:
            old[args.index("--measured-build") + 1] = tag
        yield old, args


def grid():
    shapes = sorted(glob.glob(str(ROOT / "configs/models/*.json"))) + sorted(glob.glob(str(ROOT / "scripts/gpu/shapes/*.json")))
    for shape, dtype, attention, seq, extra in itertools.product(
            shapes, ["bf16", "f32"], ["flash", "mma", "wgmma", "auto"], ["1024", "16384"],
            [[], ["--atomic-dq"], ["--checkpoint-layers", "--offload"], ["--keep-logits", "--no-reference"],
             ["--lora-r", "16"]]):
        yield ["bench", "train-step", "--predict-only", "--shape", shape, "--attention", attention,
               "--dtype", dtype, "--seq-len", seq, "--prompt-len", "256", "--answers", "4", *extra]


def plans():
    configs = sorted(p for p in glob.glob(str(ROOT / "configs/**/*.toml"), recursive=True) if "/devices/" not in p)
    for c, shape, memory, world in itertools.product(configs, sorted(glob.glob(str(ROOT / "configs/models/*.json"))),
                                                     ["80GiB", "16GiB", "1GiB"], ["1", "4"]):
        yield ["-q", "train", "--config", c, "--plan", "--model-config", shape, "--device-memory", memory,
               "--world-size", world]


def compare(before, after, pairs, what):
    """How many of `pairs` (BEFORE's arguments, AFTER's) were run, and how many printed otherwise."""
    n = differing = 0
    for old, new in pairs:
        n += 1
        if run(before, old) != run(after, new):
            differing += 1
            print(f"  {what}: DIFFERENT: {' '.join(new)}")
    return n, differing


def same(commands):
    return ((args, args) for args in commands)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--before-tags", action="store_true")
    a = ap.parse_args()
    status = 0
    for what, (n, d) in [("committed H100 steps", compare(a.before, a.after, step_pairs(a.before_tags), "step")),
                         ("predicted steps of this build", compare(a.before, a.after, same(grid()), "grid")),
                         ("plans", compare(a.before, a.after, same(plans()), "plan"))]:
        print(f"{what}: {n} compared, {n - d} equal")
        status |= d > 0
    sys.exit(status)


if __name__ == "__main__":
    main()
