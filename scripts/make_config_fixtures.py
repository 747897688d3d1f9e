#!/usr/bin/env python3
"""config.json fixtures as transformers 4 and transformers 5 write them, for tests/model_config.rs.

    python3 -m venv /tmp/tf4 && /tmp/tf4/bin/pip install "transformers<5"
    python3 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install "transformers>=5"
    /tmp/tf4/bin/python scripts/make_config_fixtures.py      # writes NAME.transformers4.json
    /tmp/tf5/bin/python scripts/make_config_fixtures.py      # writes NAME.transformers5.json

For every NAME.hub.json in tests/fixtures/configs (config.json as published on the Hugging Face hub), the
running transformers loads it with AutoConfig and writes it back with save_pretrained: transformers 4
keeps the top-level `rope_theta` / `rope_scaling` / `torch_dtype`; transformers 5 moves the rotary
settings into `rope_parameters` and the dtype into `dtype`. No torch needed (configs only).

With --check DIR... it loads each folder's config.json (checkpoints written by grpo) and prints the
rotary settings transformers reads from it, as JSON, for the test to compare across versions.
"""
import argparse, glob, json, os, shutil, sys, tempfile

import transformers
from transformers import AutoConfig

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures", "configs")


def rope_view(cfg):
    """The rotary base and scaling as this transformers version will use them."""
    params = getattr(cfg, "rope_parameters", None)
    if params is not None and int(transformers.__version__.split(".")[0]) >= 5:
        return {k: params[k] for k in sorted(params)}
    scaling = dict(cfg.rope_scaling or {"rope_type": "default"})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = cfg.rope_theta
    return {k: scaling[k] for k in sorted(scaling)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", nargs="*")
    args = ap.parse_args()
    major = transformers.__version__.split(".")[0]
    if args.check:
        print(json.dumps({d: rope_view(AutoConfig.from_pretrained(d)) for d in args.check}, indent=1))
        return
    for hub in sorted(glob.glob(os.path.join(FIXTURES, "*.hub.json"))):
        name = os.path.basename(hub)[: -len(".hub.json")]
        with tempfile.TemporaryDirectory() as src, tempfile.TemporaryDirectory() as dst:
            shutil.copy(hub, os.path.join(src, "config.json"))
            AutoConfig.from_pretrained(src).save_pretrained(dst)
            out = os.path.join(FIXTURES, f"{name}.transformers{major}.json")
            shutil.copy(os.path.join(dst, "config.json"), out)
        print(f"{out} (transformers {transformers.__version__})")


if __name__ == "__main__":
    sys.exit(main())
