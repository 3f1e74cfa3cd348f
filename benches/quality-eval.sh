#!/usr/bin/env bash
# The quality evaluation of a verdict setting against `target` mode on the development prompts: all 100 HumanEval
# problems (pass@1 by running their tests), the first 200 ASDiv problems (exact answer), and the first 20 MT-Bench and
# XSum prompts (ROUGE-L against the same run's `target` output, an open-ended proxy). Greedy, each suite's default
# budget.
#
#   benches/quality-eval.sh                                  # the default (parse+token-spec, relative, tau 0.9)
#   VERDICT=entropy TAU=0.6,0.9 OUT=bench-results/sweep benches/quality-eval.sh
#   MODES=target,parse,parse+token-spec benches/quality-eval.sh
#
# Runs in chunks of 25 (HumanEval) or 50 (ASDiv) prompts, every mode on a chunk's prompts in one process, so an
# interrupted run loses at most one chunk and each chunk's tok/s ratio comes from one process; per-prompt results
# stay in $OUT/<suite>-runs/ and a rerun reuses them (--resume). The last command of each suite aggregates every
# saved prompt into $OUT/<suite>.{md,json,png} and <suite>-work.png without generating anything. The per-prompt
# results are also packed into $OUT/<suite>-prompts.jsonl (committed for docs/bench/default-eval) and unpacked from
# there first, so a later session continues a sweep where an earlier one stopped. Quality and work figures do not
# depend on the machine (the kernels give the same bits on every CPU); tok/s do: compare them within one chunk.
set -euo pipefail
cd "$(dirname "$0")/.."
MODES="${MODES:-target,parse+token-spec}"
VERDICT="${VERDICT:-relative}"
TAU="${TAU:-0.9}"
OUT="${OUT:-bench-results/quality-eval}"
bin=target/release/parse-bench
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for packed in sorted(out.glob("*-prompts.jsonl")):
    suite = packed.name[: -len("-prompts.jsonl")]
    for line in packed.read_text().splitlines():
        rec = json.loads(line)
        path = out / f"{suite}-runs" / rec.pop("run") / f"{rec.pop('prompt')}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rec))
PY
cargo build --release -p parse-bench   # a no-op when up to date; never a stale harness
run() { "$bin" --modes "$MODES" --verdict "$VERDICT" --tau "$TAU" --out-dir "$OUT" --resume "$@"; }
for skip in 0 25 50 75; do run --suite humaneval --skip "$skip" --n 25 >/dev/null; done
run --suite humaneval --n 100
for skip in 0 50 100 150; do run --suite asdiv --skip "$skip" --n 50 >/dev/null; done
run --suite asdiv --n 200
run --suite mtbench --n 20
run --suite xsum --n 20
# Every prompt's saved result in one file per suite (run, prompt index, kept tokens, draft tokens in them, the loop's
# stats), for reading outputs side by side without the folders of small files.
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for runs in sorted(out.glob("*-runs")):
    suite = runs.name[: -len("-runs")]
    with open(out / f"{suite}-prompts.jsonl", "w") as f:
        for run in sorted(p for p in runs.iterdir() if p.is_dir()):
            for res in sorted(run.glob("*.json"), key=lambda p: int(p.stem)):
                rec = {"run": run.name, "prompt": int(res.stem), **json.loads(res.read_text())}
                f.write(json.dumps(rec) + "\n")
PY
