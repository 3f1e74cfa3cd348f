#!/usr/bin/env python3
"""Long prompts through a running router's OpenAI API (deploy/local/up.sh; start a fresh cluster for each run, so
that no prompt is in the prefix cache and, for `entry`, no drafter prefill has been priced yet). Prompts are random
common words (about one token each), seeded. Prints one JSON line.

    benches/scripts/long-prompt-latency.py prefill --tokens 8000    # one prompt alone, `target` mode, 1 new token
    benches/scripts/long-prompt-latency.py beside --tokens 8000     # that prompt, and 20 s in a streamed 16-token
                                                                    # chat request beside it: its first token and
                                                                    # its 16 tokens, in seconds
    benches/scripts/long-prompt-latency.py entry --tokens 4000      # the default mode, 4 new tokens: time, output,
                                                                    # and the draft worker's prefill rows (catching up)
"""

import argparse
import json
import random
import threading
import time
import urllib.request

WORDS = ["river", "stone", "cloud", "apple", "train", "music", "glass", "paper", "light", "green", "storm", "table"]


def post(base, path, body, timeout=3600):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def draft_rows(metrics):
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    return next((float(l.split()[1]) for l in text.splitlines() if l.startswith("parse_worker_batch_rows_sum ")), 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["prefill", "beside", "entry"])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--after-s", type=float, default=20.0, help="beside: when the short request starts")
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--draft-metrics", default="http://127.0.0.1:50062/metrics")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(a.tokens))
    out = {"case": a.case, "tokens": a.tokens, "seed": a.seed}

    if a.case == "entry":
        before = draft_rows(a.draft_metrics)
        t = time.time()
        j = json.loads(post(a.base, "/v1/completions", {"prompt": prompt, "max_tokens": 4}).read())
        out.update(s=round(time.time() - t, 1), text=j["choices"][0]["text"],
                   prompt_tokens=j["usage"]["prompt_tokens"], draft_rows=draft_rows(a.draft_metrics) - before)
        print(json.dumps(out))
        return

    def long():
        t = time.time()
        post(a.base, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "parse": {"mode": "target"}}).read()
        out["long_s"] = round(time.time() - t, 1)

    th = threading.Thread(target=long)
    th.start()
    if a.case == "beside":
        time.sleep(a.after_s)
        t, stamps = time.time(), []
        body = {"messages": [{"role": "user", "content": "Name three rivers in Europe."}], "max_tokens": 16,
                "stream": True, "parse": {"mode": "target"}}
        for line in post(a.base, "/v1/chat/completions", body):
            if line.startswith(b"data: {"):
                stamps.append(time.time() - t)
        out.update(short_first_s=round(stamps[0], 1), short_last_s=round(stamps[-1], 1))
    th.join()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
