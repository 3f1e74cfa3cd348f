"""Result records (schema parse-record/1, as crates/parse-record writes them) for the benches written in Python."""

import os
import shlex
import subprocess
import sys
import time

SCHEMA = "parse-record/1"
KERNEL_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8"]


def host():
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    fm = f"{info['cpu family']}/{info['model']}" if "cpu family" in info and "model" in info else None
    h = {"cpu": info.get("model name", os.uname().machine), "flags": [f for f in KERNEL_FLAGS if f in flags],
         "cpus": os.cpu_count() or 1}
    if fm:
        h["family_model"] = fm
    return h


def commit():
    if os.environ.get("PARSE_COMMIT"):
        return os.environ["PARSE_COMMIT"], False
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip() != ""
        return c, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def record(bench, title, settings, cells):
    """`cells`: dicts with `label`, `figures` and optionally `quality` and `headline`."""
    c, dirty = commit()
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
    return {"schema": SCHEMA, "bench": bench, "title": title, "commit": c, "dirty": dirty,
            "unix_time": int(time.time()), "host": host(), "command": shlex.join(argv), "settings": settings,
            "cells": cells}
