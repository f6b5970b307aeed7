#!/usr/bin/env python3
"""Load test for `tandem serve` on loopback (Python standard library only; docs/serve.md).

For each draft setting and concurrency level, that many client threads stream chat completions for a
fixed time: mixed greedy and seeded sampling, a share of clients disconnecting mid-stream. Then it checks
that the server had no errors, that every completed greedy stream equals the same request run alone, and
that the server's resident memory came back within a bound of its level before the load. It prints
requests/s, aggregate tokens/s and p50/p99 time to first token and inter-token latency per setting.

    cargo build --release
    scripts/serve_load.py --levels 1,8,64 --duration 60 --drafts off,auto     # the README's figures
    scripts/serve_load.py --levels 8 --duration 8 --drafts auto               # the short CI run

By default it starts the release binary itself (--port 0); --url uses a running server instead (then
memory is not checked unless --pid is given).
"""

import argparse
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "Write a function that adds two numbers.",
    "Explain what a hash map is.",
    "def quicksort(items):",
    "Write a Python class for a bank account.",
    "How do I read a file line by line in Python?",
    "Tell me a short story about a robot.",
    "What is the difference between a list and a tuple?",
    "Write a unit test for a function that reverses a string.",
]


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Client:
    def __init__(self, url, key):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def post(self, path, body, timeout=600):
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        c.request("POST", path, json.dumps(body), self.headers)
        return c, c.getresponse()

    def get(self, path):
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        c.request("GET", path, headers=self.headers)
        r = c.getresponse()
        data = r.read().decode()
        c.close()
        return r.status, data

    def stream(self, body, disconnect_after=None):
        """Stream a chat completion: (status, text, ttft, gaps, tokens, error, disconnected)."""
        body = dict(body, stream=True, stream_options={"include_usage": True})
        t0 = time.perf_counter()
        conn, r = self.post("/v1/chat/completions", body)
        if r.status != 200:
            err = r.read().decode(errors="replace")
            conn.close()
            return r.status, "", None, [], 0, err, False
        text, ttft, last, gaps, tokens, error, chunks = "", None, None, [], 0, None, 0
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                error = ev["error"]
                break
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content") or ""
                if piece:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                    text += piece
                    chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return 200, text, ttft, gaps, tokens, None, True
        conn.close()
        return 200, text, ttft, gaps, tokens, error, False


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def metric_sum(text, name, label=None):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (label is None or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_level(client, level, duration, draft, max_tokens, disconnect, solo, seed):
    rng = random.Random(seed)
    stats = {"done": 0, "disconnected": 0, "errors": [], "mismatch": [], "tokens": 0, "ttft": [], "itl": []}
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration

    def worker(i):
        r = random.Random(rng.random())
        while time.perf_counter() < stop_at:
            p = r.randrange(len(PROMPTS))
            greedy = r.random() < 0.5
            body = {"messages": [{"role": "user", "content": PROMPTS[p]}], "max_tokens": max_tokens,
                    "draft_tokens": 0 if draft == "off" else draft}
            if greedy:
                body["temperature"] = 0
            else:
                body.update(temperature=0.8, top_p=0.95, seed=r.randrange(1 << 31))
            cut = r.randrange(1, 4) if r.random() < disconnect else None
            try:
                status, text, ttft, gaps, tokens, err, dropped = client.stream(body, cut)
            except Exception as e:  # noqa: BLE001
                status, text, ttft, gaps, tokens, err, dropped = 0, "", None, [], 0, repr(e), False
            with lock:
                if status != 200 or err:
                    stats["errors"].append((status, err))
                    continue
                if dropped:
                    stats["disconnected"] += 1
                    continue
                stats["done"] += 1
                stats["tokens"] += tokens
                if ttft is not None:
                    stats["ttft"].append(ttft)
                stats["itl"].extend(gaps)
                if greedy and text != solo[p]:
                    stats["mismatch"].append((PROMPTS[p], text, solo[p]))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["seconds"] = time.perf_counter() - t0
    return stats


def start_server(args):
    cmd = [os.environ.get("TANDEM_BIN", os.path.join(ROOT, "target", "release", "tandem")), "serve", "--port", "0",
           "--max-concurrency", str(max(args.levels)), "--max-queue", str(4 * max(args.levels))]
    if args.model:
        cmd += ["--model", args.model]
    if args.assistant:
        cmd += ["--assistant", args.assistant]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url, lines = None, []
    while True:
        line = proc.stderr.readline()
        if not line:
            sys.exit("the server exited: " + "".join(lines))
        lines.append(line)
        m = re.search(r"on (http://[0-9.:]+)", line)
        if m:
            url = m.group(1)
        if "ready" in line and url:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, url


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--pid", type=int, help="the server's process id, for the memory check with --url")
    ap.add_argument("--key", default=os.environ.get("TANDEM_API_KEY"))
    ap.add_argument("--model")
    ap.add_argument("--assistant")
    ap.add_argument("--levels", default="1,8,64")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per level and draft setting")
    ap.add_argument("--drafts", default="off,auto", help="draft settings: off, auto or K, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.15, help="share of clients that hang up mid-stream")
    ap.add_argument("--rss-slack-mb", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    drafts = [d if d in ("off", "auto") else int(d) for d in args.drafts.split(",")]
    proc = None
    if args.url:
        url, pid = args.url, args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    client = Client(url, args.key)
    failed = []
    try:
        # Each prompt's greedy reply alone, without drafting: what every greedy stream under load must equal.
        solo = []
        for p in PROMPTS:
            _, text, *_ = client.stream({"messages": [{"role": "user", "content": p}], "max_tokens": args.max_tokens,
                                         "temperature": 0, "draft_tokens": 0})
            solo.append(text)
        rss_before = rss_kb(pid) if pid else None
        print(f"{'draft':>5} {'streams':>7} {'req/s':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} "
              f"{'itl p50':>8} {'itl p99':>8} {'done':>5} {'hung up':>7} {'errors':>6}")
        for draft in drafts:
            for level in args.levels:
                s = run_level(client, level, args.duration, draft, args.max_tokens, args.disconnect, solo, args.seed)
                print(f"{str(draft):>5} {level:>7} {s['done'] / s['seconds']:>7.2f} {s['tokens'] / s['seconds']:>8.1f} "
                      f"{pct(s['ttft'], 50) * 1e3:>7.0f}ms {pct(s['ttft'], 99) * 1e3:>7.0f}ms "
                      f"{pct(s['itl'], 50) * 1e3:>6.0f}ms {pct(s['itl'], 99) * 1e3:>6.0f}ms "
                      f"{s['done']:>5} {s['disconnected']:>7} {len(s['errors']):>6}", flush=True)
                for e in s["errors"][:3]:
                    failed.append(f"error at {level} streams, draft {draft}: {e}")
                for m in s["mismatch"][:3]:
                    failed.append(f"greedy stream differs from its solo output at {level} streams, draft {draft}: {m}")
        # Afterwards: no errors counted by the server, memory back near where it was.
        time.sleep(1.0)
        status, metrics = client.get("/metrics")
        errors = metric_sum(metrics, "tandem_requests_total", 'outcome="error"')
        if status != 200 or errors:
            failed.append(f"/metrics: status {status}, {errors:.0f} requests ended in a server error")
        running = metric_sum(metrics, "tandem_num_requests_running")
        if running:
            failed.append(f"{running:.0f} sequences still running after the load")
        if rss_before is not None:
            rss_after = rss_kb(pid)
            print(f"server RSS: {rss_before / 1024:.0f} MB before the load, {rss_after / 1024:.0f} MB after")
            if rss_after > rss_before + args.rss_slack_mb * 1024:
                failed.append(f"RSS grew from {rss_before / 1024:.0f} to {rss_after / 1024:.0f} MB")
    finally:
        if proc:
            proc.terminate()
            code = proc.wait(timeout=60)
            if code != 0:
                failed.append(f"the server exited with {code} on SIGTERM")
    if failed:
        for f in failed:
            print("FAIL", f)
        sys.exit(1)
    print("load test passed: no server errors, greedy streams equal their solo outputs")


if __name__ == "__main__":
    main()
