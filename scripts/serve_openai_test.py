#!/usr/bin/env python3
"""The official `openai` Python client against `tandem serve` (docs/serve.md).

Starts the release binary on a free loopback port with the shipped pair, an API key, one decoding slot and
no queue, then checks: models, chat (whole and streamed, with include_usage), logprobs, completions, greedy
output equal to `tandem generate`, and the client's exception classes for 400, 401, 404 and 429.

    python3 -m venv .venv-openai && .venv-openai/bin/pip install openai
    cargo build --release && .venv-openai/bin/python scripts/serve_openai_test.py
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("TANDEM_BIN", os.path.join(ROOT, "target", "release", "tandem"))
KEY = "test-key-123"
USER = "Write a function that adds two numbers."


def start_server():
    env = dict(os.environ, TANDEM_TEST_TOKEN_DELAY_MS="5")
    proc = subprocess.Popen(
        [BIN, "serve", "--port", "0", "--api-key", KEY, "--max-concurrency", "1", "--max-queue", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = None
    deadline = time.time() + 120
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server exited: " + "".join(lines))
        lines.append(line)
        m = re.search(r"on (http://[0-9.:]+)", line)
        if m:
            url = m.group(1)
        if "ready" in line and url:
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
            return proc, url
    proc.kill()
    raise SystemExit("the server did not start: " + "".join(lines))


def generate(*args):
    out = subprocess.run([BIN, "generate", *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    proc, url = start_server()
    failures = 0

    def check(name, cond, detail=""):
        nonlocal failures
        print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {detail}"))
        failures += 0 if cond else 1

    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        models = client.models.list()
        check("models", [m.id for m in models.data] == ["tandem-default"], models)

        g = generate("--chat", USER, "--max-new-tokens", "32")
        r = client.chat.completions.create(
            model="tandem-default", messages=[{"role": "user", "content": USER}], max_tokens=32, temperature=0
        )
        check("greedy chat equals tandem generate", r.choices[0].message.content == g["text"],
              (r.choices[0].message.content, g["text"]))
        check("usage", r.usage.completion_tokens == len(g["tokens"]) and r.usage.prompt_tokens == len(g["prompt_ids"]),
              r.usage)

        chunks = list(client.chat.completions.create(
            model="tandem-default", messages=[{"role": "user", "content": USER}], max_tokens=32, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        check("stream equals whole", text == g["text"], (text, g["text"]))
        check("one id per stream", len({c.id for c in chunks}) == 1)
        check("include_usage chunk", chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(g["tokens"]),
              chunks[-1])
        check("finish_reason", chunks[-2].choices[0].finish_reason in ("stop", "length"), chunks[-2])

        r = client.chat.completions.create(
            model="tandem-default", messages=[{"role": "user", "content": USER}], max_tokens=5, temperature=0,
            logprobs=True, top_logprobs=2)
        lp = r.choices[0].logprobs.content
        check("logprobs", len(lp) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lp), lp)

        gc = generate("--prompt", "def fibonacci(n):", "--max-new-tokens", "16")
        c = client.completions.create(model="tandem-default", prompt="def fibonacci(n):", max_tokens=16, temperature=0)
        check("completions equal tandem generate", c.choices[0].text == gc["text"], (c.choices[0].text, gc["text"]))

        def raises(name, cls, fn):
            try:
                fn()
            except cls as e:
                check(name, True)
                return e
            except Exception as e:  # noqa: BLE001
                check(name, False, f"{type(e).__name__}: {e}")
                return None
            check(name, False, "no exception")
            return None

        msgs = [{"role": "user", "content": "Hi"}]
        raises("400 BadRequestError", openai.BadRequestError,
               lambda: client.chat.completions.create(model="tandem-default", messages=msgs, temperature=5))
        raises("400 for n > 1", openai.BadRequestError,
               lambda: client.chat.completions.create(model="tandem-default", messages=msgs, n=2))
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        raises("401 AuthenticationError", openai.AuthenticationError,
               lambda: bad.chat.completions.create(model="tandem-default", messages=msgs))
        raises("404 NotFoundError", openai.NotFoundError,
               lambda: client.chat.completions.create(model="no-such-model", messages=msgs))
        # One slot and no queue: a second request while a stream runs is 429.
        held = client.chat.completions.create(model="tandem-default", messages=msgs, max_tokens=500,
                                              stream=True, extra_body={"ignore_eos": True})
        next(iter(held))
        e = raises("429 RateLimitError", openai.RateLimitError,
                   lambda: client.chat.completions.create(model="tandem-default", messages=msgs, max_tokens=2))
        check("Retry-After", e is not None and e.response.headers.get("retry-after") is not None)
        held.close()
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -1
    check("SIGTERM exits 0", code == 0, code)
    if failures:
        sys.exit(f"{failures} check(s) failed")
    print("all openai client checks passed")


if __name__ == "__main__":
    main()
