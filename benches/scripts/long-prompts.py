#!/usr/bin/env python3
"""Writes prompts of a few hundred tokens for `parsectl bench --prompts`, one per line: XSum development articles
of 220-380 tokens (their whitespace collapsed to single spaces), each behind an instruction that asks for a long
answer, so that 128 new tokens are mostly written before the end of text. Issue 15's target for `target` mode at 8
clients names prompts of a few hundred tokens and 128 new tokens; `parsectl bench`'s built-in prompts are about 40
tokens with the chat layout. Needs `pip install tokenizers`.

    benches/scripts/long-prompts.py > /tmp/long-prompts.txt
    target/release/parsectl bench --router 127.0.0.1:50051 -n 24 -c 1,8 --mode target --max-new-tokens 128 \\
        --prompts /tmp/long-prompts.txt
"""

import argparse
import json
import os
import pathlib
import sys

from tokenizers import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
EVAL = pathlib.Path(os.environ.get("PARSE_EVAL_DIR") or pathlib.Path.home() / ".cache" / "parse" / "eval")
INSTRUCTION = (
    "Write a detailed report on the following news article: what happened, who is involved, and what may follow. "
    "Article: "
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", default=str(EVAL / "xsum-dev.jsonl"))
    ap.add_argument("--tokenizer", default=str(REPO / "assets" / "tokenizer" / "qwen2.5-tokenizer.json"))
    ap.add_argument("--n", type=int, default=24, help="prompts to write")
    ap.add_argument("--min-tokens", type=int, default=220)
    ap.add_argument("--max-tokens", type=int, default=380)
    a = ap.parse_args()
    tok = Tokenizer.from_file(a.tokenizer)
    out = []
    with open(a.eval) as f:
        for line in f:
            doc = " ".join(json.loads(line)["document"].split())
            if a.min_tokens <= len(tok.encode(doc).ids) <= a.max_tokens:
                out.append(INSTRUCTION + doc)
            if len(out) == a.n:
                break
    if len(out) < a.n:
        print(f"only {len(out)} articles of {a.min_tokens}-{a.max_tokens} tokens", file=sys.stderr)
        return 1
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
