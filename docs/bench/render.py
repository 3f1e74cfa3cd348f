#!/usr/bin/env python3
"""Render docs/performance.md and the README's performance table from the result records.

The records are the JSON files under docs/bench/results/ (schema `parse-record/1`, written by the benches' `--record`
option; see crates/parse-record). Nothing in the rendered tables is typed by hand: a figure that is not in a record
is not in the docs.

    docs/bench/render.py           rewrite docs/performance.md, the README's table and the decision pages' tables
    docs/bench/render.py --check   exit 1 when any is not what the records render (CI runs this)

A decision page under docs/decisions/ that compares runs holds the markers `<!-- records:NAME -->` and
`<!-- records:end -->`; between them goes a table of the cells of every record in docs/bench/results/NAME/ (those
records are the page's and stay out of docs/performance.md).
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "bench" / "results"
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- performance:begin -->", "<!-- performance:end -->"
SCHEMA = "parse-record/1"
DECISIONS = ROOT / "docs" / "decisions"
README_ROWS = 10
# The figures a README row shows (every figure of a cell is in docs/performance.md).
README_FIGURES = ["tokens_per_s", "x_target", "ms", "x_decode_step", "x_llama_cpp"]


class RecordError(Exception):
    pass


def load(folder=RESULTS):
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except ValueError as e:
            raise RecordError(f"{path.relative_to(ROOT)}: {e}")
        if r.get("schema") != SCHEMA:
            raise RecordError(f"{path.relative_to(ROOT)}: schema {r.get('schema')!r}, expected {SCHEMA!r}")
        for key in ("bench", "title", "commit", "host", "command", "cells"):
            if key not in r:
                raise RecordError(f"{path.relative_to(ROOT)}: no {key!r}")
        r["_file"] = str(path.relative_to(RESULTS))
        records.append(r)
    return records


def num(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return ", ".join(num(x) for x in v)
    if isinstance(v, float):
        a = abs(v)
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def quality(q):
    if not q:
        return "-"
    pct = lambda x: f"{100 * x:.1f}%"
    s = f"{q['metric']} {pct(q['value'])}"
    if q.get("reference") is not None:
        s += f" (target {pct(q['reference'])})"
    return s + f", n={q['n']}"


def cpu(r):
    h = r["host"]
    fm = f", family/model {h['family_model']}" if h.get("family_model") else ""
    return f"{h['cpu']} ({h['cpus']} CPUs{fm}; {' '.join(h['flags']) or 'no AVX2'})"


def commit(r):
    return r["commit"][:10] + (" (with uncommitted changes)" if r.get("dirty") else "")


def cells_table(r):
    keys = []
    for c in r["cells"]:
        for k in c["figures"]:
            if k not in keys:
                keys.append(k)
    has_q = any(c.get("quality") for c in r["cells"])
    head = ["cell"] + keys + (["quality"] if has_q else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(keys) + (["---"] if has_q else [])) + "|"]
    for c in r["cells"]:
        row = [c["label"]] + [num(c["figures"].get(k)) for k in keys]
        if has_q:
            row.append(quality(c.get("quality")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def performance(records):
    out = [
        "# Performance",
        "",
        "Rendered by `docs/bench/render.py` from the result records in [bench/results](bench/results); do not edit.",
        "Each section is one run of one bench: the commit, the CPU and the command line that produced it, its",
        "settings, and its cells. Ratios compare cells of the same run on the same machine; figures from different",
        "CPUs are not comparable. Where a bench scores its outputs, the quality of the same outputs stands beside",
        "the speed.",
        "",
    ]
    for r in records:
        out += [
            f"## {r['title']}",
            "",
            f"- bench: `{r['bench']}`, record [`{r['_file']}`](bench/results/{r['_file']})",
            f"- commit: `{commit(r)}`",
            f"- CPU: {cpu(r)}",
            f"- command: `{r['command']}`",
        ]
        if r.get("settings"):
            out.append(f"- settings: `{json.dumps(r['settings'], sort_keys=True)}`")
        out += ["", cells_table(r), ""]
    return "\n".join(out).rstrip() + "\n"


def short_command(command):
    """The command without the options that only say where its output goes."""
    out, words = [], command.split()
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("--record", "--out-dir", "--out"):
            skip = True
            continue
        if w == "--headline":
            continue
        out.append(w)
    return " ".join(out)


def readme_table(records):
    rows = []
    for r in records:
        for c in r["cells"]:
            if c.get("headline"):
                figures = ", ".join(f"{k} {num(c['figures'][k])}" for k in README_FIGURES if k in c["figures"])
                rows.append(
                    f"| {c['label']} | {figures} | {quality(c.get('quality'))} | "
                    f"{r['host']['cpu']} | `{r['commit'][:8]}` | `{short_command(r['command'])}` |"
                )
    if len(rows) > README_ROWS:
        raise RecordError(f"{len(rows)} headline cells; the README's table holds at most {README_ROWS}")
    if not rows:
        return "No headline cells in the records yet."
    head = "| what | figures | quality | CPU | commit | command |\n|---|---|---|---|---|---|"
    return head + "\n" + "\n".join(rows)


def readme(text, table):
    if BEGIN not in text or END not in text:
        raise RecordError(f"README.md lacks the markers {BEGIN} and {END}")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


def decision_table(records):
    """One row per cell of every record: what ran (the record's settings that tell the records apart), the cell, its
    speed figures and the quality beside them."""
    if not records:
        raise RecordError("a decision page names a folder of records that holds none")
    varying = [
        k
        for k in sorted({k for r in records for k in r.get("settings", {})})
        if k != "router" and len({json.dumps(r["settings"].get(k), sort_keys=True) for r in records}) > 1
    ]
    figures = [
        "tokens_per_s",
        "x_target",
        "x_target_by_repetition",
        "x_target_mean",
        "x_target_ci95",
        "target_passes_per_token",
    ]
    figures = [f for f in figures if any(f in c["figures"] for r in records for c in r["cells"])]
    head = ["record"] + varying + ["cell"] + figures + ["quality"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * (len(varying) + 2) + ["---:"] * len(figures) + ["---"]) + "|"]
    for r in records:
        for c in r["cells"]:
            row = [f"[{pathlib.Path(r['_file']).name}](../bench/results/{r['_file']})"]
            row += [num(r["settings"].get(k)) for k in varying]
            row += [c["label"]] + [num(c["figures"].get(f)) for f in figures] + [quality(c.get("quality"))]
            lines.append("| " + " | ".join(row) + " |")
    hosts = sorted({cpu(r) for r in records})
    commits = sorted({commit(r) for r in records})
    lines += ["", f"CPU: {'; '.join(hosts)}. Commit: {', '.join(f'`{c}`' for c in commits)}."]
    return "\n".join(lines)


def decision_pages():
    """Each decision page with a records table, as the records render it."""
    pages = {}
    for page in sorted(DECISIONS.glob("*.md")):
        text = page.read_text()
        out, rest = "", text
        while "<!-- records:" in rest:
            before, after = rest.split("<!-- records:", 1)
            name, after = after.split(" -->", 1)
            if name == "end":
                raise RecordError(f"{page.relative_to(ROOT)}: <!-- records:end --> without a start")
            if "<!-- records:end -->" not in after:
                raise RecordError(f"{page.relative_to(ROOT)}: <!-- records:{name} --> without <!-- records:end -->")
            _, after = after.split("<!-- records:end -->", 1)
            table = decision_table(load(RESULTS / name))
            out += f"{before}<!-- records:{name} -->\n{table}\n<!-- records:end -->"
            rest = after
        if out:
            pages[page] = out + rest
    return pages


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail when the rendered files are stale")
    args = ap.parse_args()
    try:
        records = load()
        want = {PERFORMANCE: performance(records), README: readme(README.read_text(), readme_table(records))}
        want.update(decision_pages())
    except RecordError as e:
        print(f"render: {e}", file=sys.stderr)
        sys.exit(2)
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
            print(f"render: {names} not as the records render them; run docs/bench/render.py", file=sys.stderr)
            sys.exit(1)
        print(f"render: {len(records)} records, rendered files up to date")
        return
    for p in stale:
        p.write_text(want[p])
        print(f"render: wrote {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
