"""Write a small random-weight stand-in of a model family to a folder, to try that family's
example config end to end on one GPU before a run of the real model: the stand-ins of
tests/test_families.py (the family's real configuration class, tokenizer, chat template and
vocabulary size; 8 layers; tests/stand_ins.py), e.g. Kimi-K2.5's::

    make resources/tokenizers/deepseek_v3/tokenizer.json      # on a connected machine
    .venv/bin/python benchmarks/stand_in.py deepseek_v3 resources/kimi-k2.5-stand-in
    snakemake --cores 16 --configfile config/examples/kimi-k2.5-8gpu.yaml config/examples/kimi-k2.5-stand-in.yaml

Families: qwen3, qwen3_moe, deepseek_v3 (DeepSeek-V3 / Kimi-K2 shape, 163,840 tokens, a template
that opens ``<think>``), mistral, gpt_oss, gemma4, and qwen3_w4a16, qwen3_fp8, qwen3_fp8_blocks
(quantized; their bf16 source is left beside them, ``<dest>-bf16``). The answers of a random-weight model are noise: a run tests that every stage works
for the family, not drafter quality. Exits 2 naming the tokenizer to fetch when it is missing, and
refuses a destination that exists.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from stand_ins import FAMILIES, MissingTokenizer, stand_in  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("dest", type=Path, help="the folder to write (must not exist)")
    args = ap.parse_args(argv)
    if args.dest.exists():
        print(f"{args.dest} exists: name a new folder", file=sys.stderr)
        return 2
    try:
        stand_in(args.family, args.dest)
    except MissingTokenizer as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote the {args.family} stand-in to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
