#!/usr/bin/env python3
"""Replays a parse-bench `target` run through prompt lookup: how many target steps greedy token-level speculation
with `NgramDrafter`'s rule (latest earlier occurrence of the longest matching suffix, sizes max..min) would need,
with a verification of r rows costing 1 + c * (r - 1) one-token steps, for several per-row costs c and draft
lengths k. Prints the speed-up over the target alone (steps / speculative cost) for each, then how often the
lookup's next token is the target's, by the size of the longest match (1 to 8 tokens) at each output position:
the figures behind `CopyFirst`'s 5-token minimum. Needs `pip install tokenizers`; the prompt is rebuilt from
the fetched development prompts (deploy/eval/fetch.py) the way parse-bench builds it (XSum, HumanEval, ASDiv), inside a Qwen chat layout (the system line does
not change what matches in the prompt).

    benches/scripts/ngram-replay.py RUN_DIR [--suite xsum] [--n 20] [--row-cost 0.35]
    # RUN_DIR: <out-dir>/<suite>-runs/target-b<budget>-la3-r2 of `parse-bench --suite <suite> --modes target`

It also replays rounds whose first token waits for a longer match (3+ tokens) and shorter rounds (3 tokens), and
(with `--spec-run`) rounds that guess one token from a one-token match where nothing longer matches.

With `--spec-run DIR2` (the same bench's speculative run dir, e.g. `token-spec_ngram_adaptive-b<budget>-la3-r2`),
the row cost is read from that run instead of guessed: a one-token step's time (its plain steps, `extend_ms` over
`extend_passes`) and a verification's time by its rows (`verify_ms` over `verify_passes`, with `target_positions`
less the plain steps as rows), and the replay at that cost is printed beside the run's own count of target passes
and pauses: how far the run's rounds and pauses were from the best fixed rule at its own prices.
"""

import argparse
import json
import os
import pathlib

from tokenizers import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
EVAL = pathlib.Path(os.environ.get("PARSE_EVAL_DIR") or pathlib.Path.home() / ".cache" / "parse" / "eval")

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--suite", default="xsum", choices=["xsum", "humaneval", "asdiv"])
ap.add_argument("--n", type=int, default=20)
ap.add_argument("--row-cost", type=float, action="append", default=[],
                help="a verification row's cost past the first, in one-token steps, as `engine-bench --blocks "
                     "2,4,8` measures it on the machine at hand (repeatable); replayed beside the fixed costs, "
                     "with draft lengths 1-6 and a round's first token from matches of 2-5 tokens")
ap.add_argument("--spec-run", help="the speculative run of the same bench, to measure the row cost from")
args = ap.parse_args()
for c in args.row_cost:
    if not 0.0 <= c < float("inf"):
        ap.error(f"--row-cost {c}: a row's cost is a finite number of steps, 0 or more")

tok = Tokenizer.from_file(str(REPO / "assets" / "tokenizer" / "qwen2.5-tokenizer.json"))
recs = [json.loads(line) for line in open(EVAL / f"{args.suite}-dev.jsonl") if line.strip()][: args.n]


def user_text(r):
    # As parse-bench's `load_records` words each suite's prompt.
    if args.suite == "xsum":
        return "Summarize the following article in one sentence.\n\n" + r["document"][:2000]
    if args.suite == "humaneval":
        return ("Complete the following Python function. Reply with the whole function in one ```python code "
                "block.\n\n```python\n" + r["prompt"] + "```")
    return (r.get("passage", "") + " " + r["question"]
            + "\nSolve it step by step, then give the final number on the last line as 'Answer: <number>'.")


data = []
for i, r in enumerate(recs):
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + user_text(r)
              + "<|im_end|>\n<|im_start|>assistant\n")
    x = tok.encode(prompt, add_special_tokens=False).ids
    y = json.load(open(pathlib.Path(args.run_dir) / f"{i}.json"))["tokens"]
    data.append((x, y))


def lookup(ctx, lo, hi):
    n_ctx = len(ctx)
    for n in range(hi, lo - 1, -1):
        if n_ctx <= n:
            continue
        suffix = ctx[n_ctx - n:]
        for i in range(n_ctx - n - 1, -1, -1):
            if ctx[i:i + n] == suffix:
                return ctx[i + n]
    return None


def speedup(lo, hi, k, c_row, first=None, guess=False):
    """Target steps over speculative cost; with `first`, a round's first token is drafted only from a match of at
    least `first` tokens (sizes max(hi, first)..first), later ones from matches of lo..hi as before. With `guess`,
    where nothing of lo..hi matches, a draft of one token from a one-token match (`Drafter::guess_lookup`)."""
    cost, steps = 0.0, 0
    for x, y in data:
        # The target alone makes one pass per output token and one more (`parse-bench` counts 1.03 passes a token
        # in `target` mode on XSum); speculation makes that one too: charged to both, as the measured times hold it.
        steps += len(y) + 1
        cost += 1
        i = 0
        while i < len(y):
            ctx, draft = x + y[:i], []
            while len(draft) < k:
                if first is not None and not draft:
                    t = lookup(ctx, first, max(hi, first))
                else:
                    t = lookup(ctx + draft, lo, hi)
                if t is None:
                    break
                draft.append(t)
            if not draft and guess:
                t = lookup(ctx, 1, 1)
                draft = [] if t is None else [t]
            if not draft:
                cost, i = cost + 1, i + 1
                continue
            a = 0
            while a < len(draft) and i + a < len(y) and draft[a] == y[i + a]:
                a += 1
            cost += 1 + c_row * len(draft)
            i += a + 1
    return steps / cost


for c_row in args.row_cost:
    for f in (2, 3, 4, 5):
        print(f"per-row cost {c_row}, first>={f}: " + "  ".join(
            f"k={k}: {speedup(2, 8, k, c_row, first=f):.2f}x" for k in (1, 2, 3, 4, 6)))
    for g in (False, True):
        print(f"per-row cost {c_row}, sizes 4..2 (as shipped){', one-token guesses' if g else ''}: " + "  ".join(
            f"k={k}: {speedup(2, 4, k, c_row, guess=g):.2f}x" for k in (2, 3, 4, 6)))

for c_row in (0.6, 0.2, 0.1, 0.05):
    print(f"per-row cost {c_row}: " + "  ".join(f"k={k}: {speedup(2, 4, k, c_row):.2f}x" for k in (2, 4, 6)))


print("a round's first token only from a match of 2 (as shipped) or 3+ tokens (sizes up to 8), k draft tokens:")
for c_row in (0.6, 0.23, 0.1):
    print(f"per-row cost {c_row}: " + "  ".join(
        f"first>={f} k={k}: {speedup(2, 8, k, c_row, first=f):.2f}x" for f in (2, 3) for k in (3, 6)))


def lookup_size(ctx, hi):
    """The next token by the longest earlier match of size 1..hi, and that size (None, 0 without a match)."""
    n_ctx = len(ctx)
    for n in range(hi, 0, -1):
        if n_ctx <= n:
            continue
        suffix = ctx[n_ctx - n:]
        for i in range(n_ctx - n - 1, -1, -1):
            if ctx[i:i + n] == suffix:
                return ctx[i + n], n
    return None, 0


if args.spec_run:
    tot = {}
    for i in range(args.n):
        saved = pathlib.Path(args.spec_run) / f"{i}.json"
        if not saved.is_file():
            raise SystemExit(f"--spec-run {args.spec_run}: no {saved.name} (a speculative run of the same --suite "
                             f"and at least --n {args.n} prompts)")
        st = json.load(open(saved))["stats"]
        for key in ("extend_ms", "extend_passes", "verify_ms", "verify_passes", "target_positions",
                    "output_tokens", "target_passes", "pauses", "paused_tokens"):
            tot[key] = tot.get(key, 0) + st.get(key, 0)
    if tot["extend_passes"] == 0 or tot["verify_passes"] == 0:
        raise SystemExit(f"{args.spec_run}: no plain steps or no verifications to measure a row's cost from")
    step = tot["extend_ms"] / tot["extend_passes"]
    rows = (tot["target_positions"] - tot["extend_passes"]) / tot["verify_passes"]
    verify = tot["verify_ms"] / tot["verify_passes"]
    c_run = max(verify - step, 0.0) / max(rows - 1.0, 1e-9) / step
    steps = sum(len(y) + 1 for _, y in data)
    print(f"the run: a step {step:.1f} ms, a verification {verify:.1f} ms at {rows:.2f} rows: a row past the first "
          f"{c_run:.3f} of a step; {tot['target_passes']} target passes for {tot['output_tokens']} tokens, "
          f"{tot['pauses']} pauses ({tot['paused_tokens']} tokens alone); at that row cost the run's own passes "
          f"and rows give {steps / (tot['target_passes'] + c_run * (tot['target_positions'] - tot['target_passes'])):.2f}x")
    best = max((speedup(2, 4, k, c_run), k) for k in range(1, 7))
    print(f"replayed at the run's row cost, sizes 4..2 (as shipped): best {best[0]:.2f}x at k={best[1]}; "
          + "  ".join(f"k={k}: {speedup(2, 4, k, c_run):.2f}x" for k in (2, 3, 4, 6)))
    best = max((speedup(2, 4, k, c_run, guess=True), k) for k in range(1, 7))
    print(f"  with one-token guesses where nothing of 2+ tokens matches: best {best[0]:.2f}x at k={best[1]}; "
          + "  ".join(f"k={k}: {speedup(2, 4, k, c_run, guess=True):.2f}x" for k in (2, 3, 4, 6)))

proposed, right, positions = [0] * 9, [0] * 9, 0
for x, y in data:
    for i in range(len(y)):
        t, n = lookup_size(x + y[:i], 8)
        positions += 1
        if t is not None:
            proposed[n] += 1
            right[n] += t == y[i]
print(f"{positions} output positions; the lookup's token against the target's, by the longest match (8: 8 or more)")
for n in range(1, 9):
    if proposed[n]:
        print(f"  match {n}: {proposed[n]} proposed, {right[n]} right ({right[n] / proposed[n]:.2f})")
