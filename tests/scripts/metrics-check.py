#!/usr/bin/env python3
"""The Prometheus metrics of a running local cluster, read with a real Prometheus parser.

    tests/scripts/metrics-check.py [ROUTER_HTTP] [DRAFT_METRICS] [TARGET_METRICS]
    # defaults: http://127.0.0.1:8000 http://127.0.0.1:50062 http://127.0.0.1:50070 (deploy/local/up.sh's)

Installs the pinned `prometheus-client` into .cache/ci-tools/prometheus-client (git-ignored) on first use. Parses the
`/metrics` of the router and both workers with its text parser, sends one known request through the OpenAI API, and
checks that the counters moved by the amounts the request's own usage reports: the router's requests, output tokens,
accepted draft tokens, target passes and first-token histogram, the per-position and per-worker series; the target worker's session open (its prompt rows, computed or reused)
and release and its verifications; the draft worker's drafted tokens; no session left open, a KV capacity, an empty
queue; then a prompt-lookup request's one-token guesses, kept and missed.
Run it with no other client on the cluster. Exits non-zero on the first failed check.
"""

import json
import pathlib
import subprocess
import sys
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOLS = REPO / ".cache" / "ci-tools" / "prometheus-client"
if not (TOOLS / "prometheus_client").is_dir():
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-conflicts",
         "--target", str(TOOLS), "prometheus-client==0.23.1"],
        check=True,
    )
sys.path.insert(0, str(TOOLS))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

defaults = ["http://127.0.0.1:8000", "http://127.0.0.1:50062", "http://127.0.0.1:50070"]
router, draft, target = (sys.argv[1:4] + defaults[len(sys.argv[1:4]):])


def check(cond, what):
    if not cond:
        sys.exit(f"metrics-check: FAILED: {what}")
    print(f"metrics-check: ok: {what}", file=sys.stderr)


def scrape(base):
    """{(sample name, frozenset(labels)): value} of every sample at base/metrics (the parser raises on bad text)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
        ctype = r.headers.get("Content-Type", "")
    check(ctype.startswith("text/plain"), f"{base}/metrics content type {ctype!r}")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def get(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


before = {k: scrape(v) for k, v in [("router", router), ("draft", draft), ("target", target)]}
check(all(before.values()), "all three expositions parse and are not empty")

body = json.dumps({
    "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    "max_tokens": 24,
    # The draft model alone: the draft worker's rows are checked against the proposed tokens below (the router's
    # default drafter, model+ngram, also proposes copies the worker never drafts).
    "parse": {"drafter": "model"},
}).encode()
req = urllib.request.Request(f"{router}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=600) as r:
    reply = json.load(r)
usage = reply["usage"]
figures = usage["parse"]
mode = figures["mode"]
after = {k: scrape(v) for k, v in [("router", router), ("draft", draft), ("target", target)]}


def delta(who, name, **labels):
    return get(after[who], name, **labels) - get(before[who], name, **labels)


def delta_sum(who, name, **labels):
    """The change of every series of `name` whose labels include `labels`, summed (over the others' values)."""
    want = set(labels.items())

    def total(samples):
        return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
    return total(after[who]) - total(before[who])


def present(who, name):
    return any(n == name for (n, _) in after[who])


m = {"mode": mode}
check(delta("router", "parse_requests_total", outcome="ok", **m) == 1, "router: one more ok request")
check(delta("router", "parse_output_tokens_total", **m) == usage["completion_tokens"],
      f"router: output tokens +{usage['completion_tokens']}")
check(delta("router", "parse_draft_tokens_accepted_total", **m) == figures["draft_tokens_accepted"],
      f"router: accepted draft tokens +{figures['draft_tokens_accepted']}")
check(delta("router", "parse_draft_tokens_proposed_total", **m) == figures["draft_tokens_proposed"],
      f"router: proposed draft tokens +{figures['draft_tokens_proposed']}")
check(delta("router", "parse_target_passes_total", **m) == figures["target_passes"],
      f"router: target passes +{figures['target_passes']}")
check(delta("router", "parse_paused_tokens_total", **m) == figures["paused_tokens"],
      f"router: tokens written while speculation paused +{figures['paused_tokens']}")
check(delta("router", "parse_copy_rounds_total", **m) == figures["copy_rounds"],
      f"router: copy rounds +{figures['copy_rounds']}")
check(delta("router", "parse_time_to_first_token_seconds_count", **m) == 1, "router: one first-token sample")
check(delta("router", "parse_request_duration_seconds_count", **m) == 1, "router: one latency sample")
check(get(after["router"], "parse_requests_in_flight") == 0, "router: nothing in flight")
# Per draft position: every proposed (accepted) draft token is one position's count.
check(delta_sum("router", "parse_draft_position_proposed_total", **m) == figures["draft_tokens_proposed"],
      "router: proposed tokens by position sum to the request's")
check(delta_sum("router", "parse_draft_position_accepted_total", **m) == figures["draft_tokens_accepted"],
      "router: accepted tokens by position sum to the request's")
check(delta("router", "parse_draft_position_accepted_total", position="0", **m)
      <= delta("router", "parse_draft_position_proposed_total", position="0", **m),
      "router: position 0 kept no more often than proposed")
# Per worker: the request counts once for the target that served it, with its output tokens.
check(delta_sum("router", "parse_worker_requests_total", role="target", outcome="ok") == 1,
      "router: one more request served by a target worker")
check(delta_sum("router", "parse_worker_output_tokens_total", role="target") == usage["completion_tokens"],
      "router: the target worker's output tokens")

check(delta("target", "parse_worker_steps_total", op="open") == 1, "target: one session opened")
# The prompt's rows are computed or taken from a prompt kept earlier (prefix caching: the chat layout's first tokens
# are the same as the earlier requests'), and the two together are all but the pending token.
computed = delta("target", "parse_worker_rows_total", op="open")
reused = delta("target", "parse_worker_prefix_rows_total", op="open")
check(computed > 0 and computed + reused == usage["prompt_tokens"] - 1,
      f"target: prompt rows computed {computed:g} + reused {reused:g} == {usage['prompt_tokens'] - 1}"
      " (all but the pending token)")
check(delta("target", "parse_worker_steps_total", op="release") == 1, "target: one session released")
check(delta("target", "parse_worker_steps_total", op="verify") >= 1, "target: verifications ran")
check(delta("target", "parse_worker_rows_total", op="verify")
      >= delta("target", "parse_worker_steps_total", op="verify"), "target: each verification has rows")
check(get(after["target"], "parse_worker_open_sessions") == 0, "target: no session left open")
check(get(after["target"], "parse_worker_kv_capacity_bytes") > 0, "target: a KV capacity")
for w in ("draft", "target"):
    check(present(w, "parse_worker_queue_depth") and get(after[w], "parse_worker_queue_depth") == 0,
          f"{w}: a queue depth, nothing waiting")
# Every process's CPU time (what `parse-bench --cpu-metrics` sums): the target worker's grew with the request's passes.
for w in ("router", "draft", "target"):
    check(present(w, "process_cpu_seconds_total") and delta(w, "process_cpu_seconds_total") >= 0,
          f"{w}: its CPU time, never falling")
check(delta("target", "process_cpu_seconds_total") > 0, "target: CPU time spent on the request")

# Drafting ahead may write tokens the loop never asks for: at least the proposed ones were drafted.
check(delta("draft", "parse_worker_rows_total", op="draft") >= figures["draft_tokens_proposed"],
      f"draft: drafted tokens >= {figures['draft_tokens_proposed']}")
check(get(after["draft"], "parse_worker_open_sessions") == 0, "draft: no session left open")

# Prompt lookup in the router, token-level rounds: its one-token guesses (where nothing longer matches) move
# parse_guesses_total by the request's own figures, kept and missed.
before = after
body = json.dumps({
    "messages": [{"role": "user", "content": "Repeat this list twice: red, green, blue, red, green, blue."}],
    "max_tokens": 32,
    "parse": {"drafter": "ngram", "mode": "token-spec"},
}).encode()
req = urllib.request.Request(f"{router}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=600) as r:
    lookup = json.load(r)["usage"]["parse"]
after = {"router": scrape(router)}
m = {"mode": lookup["mode"]}
kept, made = lookup["guesses_right"], lookup["guesses"]
check(kept <= made, f"router: guesses kept {kept} of {made}")
check(delta("router", "parse_guesses_total", outcome="kept", **m) == kept, f"router: guesses kept +{kept}")
check(delta("router", "parse_guesses_total", outcome="missed", **m) == made - kept,
      f"router: guesses missed +{made - kept}")
print("metrics-check: all checks passed", file=sys.stderr)
