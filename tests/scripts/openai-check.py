#!/usr/bin/env python3
"""The official `openai` Python package against a running router's OpenAI-compatible API.

    tests/scripts/openai-check.py [BASE_URL]     # default http://127.0.0.1:8000/v1

Installs the pinned package into .cache/ci-tools/openai (git-ignored) on first use. Checks: models.list; a chat
completion; the same request streamed (chunks reassemble into the same text, same finish reason and token count, usage
in the last chunk with stream_options.include_usage; the same prompt's tokens reported cached the second time, in
usage.prompt_tokens_details, at the workers' default prefix cache); a text completion; the `parse` extension object reaching the
loop (mode echoed in usage.parse); a stop string's answer counted up to the token that completed it; models.retrieve; bad requests raising BadRequestError / NotFoundError with OpenAI's error shape; top_k = -1 (vLLM's
no cut) accepted; 413 and 405 answered in OpenAI's error shape.
Exits non-zero on the first failed check.
"""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOLS = REPO / ".cache" / "ci-tools" / "openai"
if not (TOOLS / "openai").is_dir():
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-conflicts",
         "--target", str(TOOLS),
         "openai==1.109.1"],
        check=True,
    )
sys.path.insert(0, str(TOOLS))

import openai  # noqa: E402

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
# No retries: a 429 or 503 must show, not be hidden by the client's back-off.
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)


def check(cond, what):
    if not cond:
        sys.exit(f"openai-check: FAILED: {what}")
    print(f"openai-check: ok: {what}", file=sys.stderr)


models = client.models.list().data
check(len(models) == 1 and models[0].id, f"models.list serves one model ({[m.id for m in models]})")
model = models[0].id
check(client.models.retrieve(model).id == model, f"models.retrieve({model!r})")
try:
    client.models.retrieve("no-such-model")
    check(False, "models.retrieve of an unknown model was refused")
except openai.NotFoundError as e:
    check(model in str(e.body), f"models.retrieve of an unknown model: 404 naming the served one ({e.body})")
messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]

full = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
text = full.choices[0].message.content
check(full.object == "chat.completion" and text, f"chat completion: {text!r}")
check(full.choices[0].finish_reason in ("stop", "length"), f"finish reason {full.choices[0].finish_reason}")
check(0 < full.usage.completion_tokens <= 32 and full.usage.prompt_tokens > 0, f"usage {full.usage}")
figures = full.usage.model_extra.get("parse") or {}
check(figures.get("mode") and "draft_tokens_accepted" in figures, f"usage.parse carries the figures: {figures}")

parts, finish, usage, roles = [], None, None, []
for chunk in client.chat.completions.create(
    model=model, messages=messages, max_tokens=32, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        parts.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
check("".join(parts) == text, f"streamed chunks reassemble into the same text ({len(parts)} chunks)")
check(roles == ["assistant"], f"one role delta, first: {roles}")
check(finish == full.choices[0].finish_reason, f"streamed finish reason {finish}")
check(usage is not None and usage.completion_tokens == full.usage.completion_tokens,
      f"usage in the last chunk: {usage}")
# Prefix caching (the workers' default): the first request's prompt was kept, so the same prompt again takes all its
# rows but the pending token's from it, and says so as OpenAI does.
first_cached = full.usage.prompt_tokens_details.cached_tokens
check(0 <= first_cached < full.usage.prompt_tokens, f"first request: {first_cached} cached prompt tokens")
check(usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1,
      f"the same prompt again: usage.prompt_tokens_details {usage.prompt_tokens_details}, all but the pending token")

comp = client.completions.create(model=model, prompt="def add(a, b):\n    return", max_tokens=8, temperature=0)
check(comp.object == "text_completion" and comp.choices[0].text, f"text completion: {comp.choices[0].text!r}")

streamed = "".join(
    c.choices[0].text for c in client.completions.create(
        model=model, prompt="def add(a, b):\n    return", max_tokens=8, temperature=0, stream=True)
    if c.choices
)
check(streamed == comp.choices[0].text, "streamed text completion equals the unary one")

# A prompt of token ids: those of the text above in the default pair's tokenizer (Qwen2.5's). `target` mode on both
# sides, whose output does not depend on the load.
ADD_IDS = [750, 912, 2877, 11, 293, 982, 262, 470]
as_text = client.completions.create(model=model, prompt="def add(a, b):\n    return", max_tokens=8, temperature=0,
                                    extra_body={"parse": {"mode": "target"}})
for prompt in (ADD_IDS, [ADD_IDS]):
    as_ids = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"parse": {"mode": "target"}})
    check(as_ids.choices[0].text == as_text.choices[0].text
          and as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ADD_IDS),
          f"a prompt of token ids {'in an array ' if prompt != ADD_IDS else ''}answers as its text: "
          f"{as_ids.choices[0].text!r}, {as_ids.usage.prompt_tokens} prompt tokens")
try:
    client.completions.create(model=model, prompt=[1, 10**9], max_tokens=4)
    check(False, "a token id past the vocabulary is refused")
except openai.BadRequestError as e:
    check("outside the model's vocabulary" in str(e), f"a token id past the vocabulary: 400, {e}")

target = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"parse": {"mode": "target"}})
check(target.usage.model_extra["parse"]["mode"] == "target", "the parse extension object picks the mode")
# Prompt lookup drafts in the router; greedy token-level speculation with it writes the target's own tokens.
lookup = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0,
    extra_body={"parse": {"mode": "token-spec", "drafter": "ngram"}})
check(lookup.choices[0].message.content == target.choices[0].message.content,
      "token-spec with the ngram drafter writes target's text")
# Copies of long matches in the router, the draft worker for the rest: still the target's own tokens.
copy_first = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0,
    extra_body={"parse": {"mode": "token-spec", "drafter": "model+ngram"}})
check(copy_first.choices[0].message.content == target.choices[0].message.content,
      "token-spec with the model+ngram drafter writes target's text")

# A stop string ends the answer at the token that completed it: the loop may accept tokens past it in the same round,
# and completion_tokens counts the answer's alone. Greedy token-level speculation writes target's tokens, so the two
# count the same.
counting = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
counts = {}
for mode in ("target", "token-spec", None):
    extra = {"extra_body": {"parse": {"mode": mode}}} if mode else {}
    whole = client.chat.completions.create(model=model, messages=counting, max_tokens=64, temperature=0, **extra)
    cut = client.chat.completions.create(
        model=model, messages=counting, max_tokens=64, temperature=0, stop=["7"], **extra)
    content = cut.choices[0].message.content
    name = mode or "the default"
    check("7" in whole.choices[0].message.content and content == whole.choices[0].message.content.split("7")[0],
          f"{name}: the stop string cuts the text: {content!r}")
    check(cut.choices[0].finish_reason == "stop", f"{name}: finish reason {cut.choices[0].finish_reason}")
    check(0 < cut.usage.completion_tokens < whole.usage.completion_tokens,
          f"{name}: {cut.usage.completion_tokens} tokens up to the stop string, of {whole.usage.completion_tokens}")
    counts[name] = cut.usage.completion_tokens
check(counts["target"] == counts["token-spec"], f"target and token-spec count the same stopped answer: {counts}")

for what, kwargs, error in [
    ("n = 2", {"n": 2}, openai.BadRequestError),
    ("max_tokens = 0", {"max_tokens": 0}, openai.BadRequestError),
    ("an unknown verdict", {"extra_body": {"parse": {"verdict": "vibes"}}}, openai.BadRequestError),
    ("an unknown drafter", {"extra_body": {"parse": {"drafter": "eagle"}}}, openai.BadRequestError),
    ("a sampled PARSE request", {"temperature": 0.7, "extra_body": {"parse": {"mode": "parse"}}},
     openai.BadRequestError),
    ("an unknown model", {"model": "no-such-model"}, openai.NotFoundError),
    ("top_k = -2", {"extra_body": {"top_k": -2}}, openai.BadRequestError),
    ("a stop that is a number", {"extra_body": {"stop": 5}}, openai.BadRequestError),
]:
    args = {"model": model, "messages": messages, "max_tokens": 8, **kwargs}
    try:
        client.chat.completions.create(**args)
        check(False, f"{what} was refused")
    except error as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(body.get("message"), f"{what}: {e.status_code} {body.get('message')!r}")

# vLLM's way of saying "no top-k cut" is accepted.
nocut = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"top_k": -1})
check(nocut.choices[0].message.content == client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0).choices[0].message.content,
    "top_k = -1 (vLLM's no cut) answers as top_k left out")

# Errors the router answers before any handler runs come in OpenAI's shape too: a body past the size limit (413)
# and a method the route does not take (405).
import json  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

for what, method, path, data, status in [
    ("a body past the size limit", "POST", "/chat/completions",
     json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * (3 << 20)}]}).encode(), 413),
    ("GET on a POST route", "GET", "/chat/completions", None, 405),
]:
    req = urllib.request.Request(base.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer unused"})
    try:
        urllib.request.urlopen(req, timeout=60)
        check(False, f"{what} was refused")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"null") if e.headers.get_content_type() == "application/json" else None
        message = ((body or {}).get("error") or {}).get("message")
        check(e.code == status and message, f"{what}: {e.code} {message!r}")

print("openai-check: all checks passed", file=sys.stderr)
