#!/usr/bin/env python3
"""Soak and chaos: N greedy streams for a set time against `kvx serve`, or against a fleet
(`kvx frontend` and W `kvx worker`s, optionally found through a real etcd) while workers are
SIGKILLed and restarted, or SIGSTOPped and continued, at random, and etcd is restarted.

Every process's RSS and open file descriptors are sampled over time, with the server's KV
blocks in use, requests and errors; at the end the KV blocks in use must be back to 0. With
--check-identity (fleet), every prompt is first run once on the calm fleet, and every output
of the run must equal its calm output. Writes summary.json and an HTML report with the curves.

  soak:  bench/scripts/soak.py --duration 1800 --streams 64
  chaos: bench/scripts/soak.py --fleet 4 --duration 600 --streams 32 --chaos kill,stop \
             --chaos-interval 30 --check-identity [--etcd --etcd-restart-interval 120]

Environment: KVX (the binary, default target/release/kvx), KVX_TEST_MODEL (the GGUF served;
default: kvx's default model), ETCD (default etcd).
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVX = os.environ.get("KVX", os.path.join(ROOT, "target/release/kvx"))
TOPICS = ["the sea", "a clock", "bread", "winter", "a library", "bees", "a bridge", "rain",
          "chess", "a lighthouse", "paper", "the moon", "a garden", "trains", "salt", "glass"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process of this script (the only processes it signals)."""

    def __init__(self, name, args, out_dir):
        self.name, self.args, self.out_dir = name, args, out_dir
        self.restarts = 0
        self.start()

    def start(self):
        log = open(os.path.join(self.out_dir, f"{self.name}.{self.restarts}.log"), "w")
        self.p = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        self.stopped = False

    def restart(self):
        self.kill()
        self.restarts += 1
        self.start()

    def kill(self):
        if self.p.poll() is None:
            if self.stopped:
                os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
            self.p.wait()

    def alive(self):
        return self.p.poll() is None

    def sample(self):
        pid = self.p.pid
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            return rss / 1024.0, fds
        except (OSError, StopIteration):
            return None, None


def get(port, path, timeout=5):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def metric(port, series):
    try:
        _, text = get(port, "/metrics")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, v = line.rpartition(" ")
        if name == series:
            return float(v)
    return None


def wait_until(pred, secs, what):
    end = time.time() + secs
    while time.time() < end:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"timed out waiting for {what}")


def prompt(i):
    return f"Tell me a long story about {TOPICS[i % len(TOPICS)]} (story {i})."


def stream(port, i, max_tokens, timeout=300):
    """One greedy streamed chat completion of prompt i: (text, finish reason) or raises."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt(i)}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"http_{r.status}: {r.read()[:300]!r}")
        text, finish, done = [], None, False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error'].get('message')}")
            ch = ev["choices"][0]
            text.append((ch.get("delta") or {}).get("content") or "")
            finish = ch.get("finish_reason") or finish
        if not done or finish is None:
            raise RuntimeError("stream ended early")
        return "".join(text), finish
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1800)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts cycled through")
    ap.add_argument("--fleet", type=int, default=0, help="workers (0: kvx serve)")
    ap.add_argument("--engine", default="model", choices=["model", "mocker"])
    ap.add_argument("--chaos", default="", help="comma list of kill, stop")
    ap.add_argument("--chaos-interval", type=float, default=30)
    ap.add_argument("--stop-secs", type=float, default=8, help="how long a stopped worker stays stopped")
    ap.add_argument("--migration-limit", type=int, default=3)
    ap.add_argument("--etcd", action="store_true", help="fleet discovery through a real etcd")
    ap.add_argument("--etcd-restart-interval", type=float, default=0)
    ap.add_argument("--check-identity", action="store_true")
    ap.add_argument("--sample-interval", type=float, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("serve_args", nargs="*", help="more kvx serve / frontend flags (after --)")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="kvx-soak-")
    os.makedirs(out, exist_ok=True)
    model = os.environ.get("KVX_TEST_MODEL")
    margs = ["--model", model] if model else []
    port = free_port()
    procs, workers, etcd = [], [], None
    if a.fleet == 0:
        server = Proc("serve", [KVX, "serve", "--port", str(port), "--engine", a.engine] + margs
                      + a.serve_args, out)
        procs.append(server)
    else:
        wport = free_port()
        disc = []
        if a.etcd:
            cport, pport = free_port(), free_port()
            etcd = Proc("etcd", [os.environ.get("ETCD", "etcd"), "--data-dir", os.path.join(out, "etcd"),
                                 "--listen-client-urls", f"http://127.0.0.1:{cport}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{pport}"], out)
            procs.append(etcd)
            disc = ["--discovery", "etcd", "--etcd-endpoints", f"http://127.0.0.1:{cport}",
                    "--namespace", "soak", "--lease-ttl", "3"]
            time.sleep(1)
        server = Proc("frontend", [KVX, "frontend", "--port", str(port), "--worker-listen",
                                   f"127.0.0.1:{wport}", "--migration-limit",
                                   str(a.migration_limit)] + margs + disc + a.serve_args, out)
        procs.append(server)
        wait_until(lambda: get(port, "/health")[0] == 200, 60, "the frontend")
        for w in range(a.fleet):
            wargs = [KVX, "worker", "--engine", a.engine, "--worker-id", str(w + 1), "--shards", "1",
                     "--threads-per-shard", "1"] + margs
            wargs += ["--listen", "127.0.0.1:0"] + disc if a.etcd else ["--frontend", f"127.0.0.1:{wport}"]
            workers.append(Proc(f"worker{w + 1}", wargs, out))
            procs.append(workers[-1])
        wait_until(lambda: metric(port, "kvx_router_plane_workers") == a.fleet, 120, "the workers")
    wait_until(lambda: get(port, "/ready")[0] == 200, 120, "the server to be ready")

    calm = {}
    if a.check_identity:
        print(f"calm run: {a.prompts} prompts", flush=True)
        lock = threading.Lock()

        def calm_one(i):
            t, _ = stream(port, i, a.max_tokens)
            with lock:
                calm[i] = t

        ts = [threading.Thread(target=calm_one, args=(i,)) for i in range(a.prompts)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(calm) == a.prompts, "the calm run failed"

    kv_before = metric(port, "kvx_kv_blocks_active")
    t0 = time.time()
    end = t0 + a.duration
    lock = threading.Lock()
    results, samples, events = [], [], []
    stop_all = threading.Event()

    def client(k):
        n = 0
        while time.time() < end and not stop_all.is_set():
            i = (k * 7919 + n) % a.prompts
            n += 1
            s = time.time()
            try:
                text, finish = stream(port, i, a.max_tokens)
                err = None
                mismatch = a.check_identity and text != calm[i]
            except Exception as e:  # every failure a client sees is recorded
                err, mismatch, finish = str(e)[:300], False, None
            with lock:
                results.append({"t": s - t0, "dt": time.time() - s, "prompt": i, "error": err,
                                "mismatch": mismatch, "finish": finish})

    def sampler():
        while not stop_all.is_set():
            row = {"t": time.time() - t0, "kv_active": metric(port, "kvx_kv_blocks_active"),
                   "procs": {}}
            for p in procs:
                rss, fds = p.sample()
                row["procs"][p.name] = {"rss_mib": rss, "fds": fds}
            with lock:
                row["done"] = len(results)
                row["errors"] = sum(1 for r in results if r["error"])
            samples.append(row)
            stop_all.wait(a.sample_interval)

    def chaos():
        rng = random.Random(1)
        actions = [x for x in a.chaos.split(",") if x]
        next_etcd = t0 + a.etcd_restart_interval if a.etcd_restart_interval > 0 else float("inf")
        next_chaos = t0 + a.chaos_interval
        while not stop_all.is_set() and time.time() < end:
            now = time.time()
            if actions and workers and now >= next_chaos:
                next_chaos += a.chaos_interval
                w = rng.choice(workers)
                act = rng.choice(actions)
                events.append({"t": now - t0, "what": f"{act} {w.name}"})
                print(f"[{now - t0:7.1f}s] {act} {w.name}", flush=True)
                if act == "kill":
                    w.p.kill()
                    w.p.wait()
                    time.sleep(1)
                    w.restart()
                elif act == "stop":
                    os.kill(w.p.pid, signal.SIGSTOP)
                    w.stopped = True
                    time.sleep(a.stop_secs)
                    os.kill(w.p.pid, signal.SIGCONT)
                    w.stopped = False
            if etcd and now >= next_etcd:
                next_etcd += a.etcd_restart_interval
                events.append({"t": now - t0, "what": "restart etcd"})
                print(f"[{now - t0:7.1f}s] restart etcd", flush=True)
                etcd.p.terminate()
                etcd.p.wait()
                time.sleep(2)
                etcd.restarts += 1
                etcd.start()
            time.sleep(0.2)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.streams)]
    aux = [threading.Thread(target=sampler), threading.Thread(target=chaos)]
    for t in threads + aux:
        t.start()
    last = 0
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        if time.time() - last >= 60:
            last = time.time()
            with lock:
                n, e = len(results), sum(1 for r in results if r["error"])
            print(f"[{time.time() - t0:7.1f}s] {n} requests, {e} errors", flush=True)
        for t in threads:
            t.join(timeout=0)
    stop_all.set()
    for t in aux:
        t.join()
    time.sleep(5)
    kv_after = metric(port, "kvx_kv_blocks_active")
    inflight_after = metric(port, "kvx_inflight_requests")
    migrated = metric(port, "kvx_router_plane_requests_migrated_total")
    final = {p.name: p.sample() for p in procs}
    for p in reversed(procs):
        p.kill()

    # The bar's figures: over the run after its first five minutes (or its first sixth).
    warm = min(300.0, a.duration / 6)
    late = [s for s in samples if s["t"] >= warm]
    growth = {}
    for p in procs:
        if p in workers and a.chaos:
            continue  # restarted processes have no single curve
        rs = [s["procs"][p.name]["rss_mib"] for s in late if s["procs"][p.name]["rss_mib"]]
        fs = [s["procs"][p.name]["fds"] for s in late if s["procs"][p.name]["fds"]]
        if rs:
            growth[p.name] = {"rss_at_warm_mib": rs[0], "rss_max_after_mib": max(rs),
                              "rss_end_mib": rs[-1], "rss_growth": max(rs) / rs[0] - 1,
                              "fds_at_warm": fs[0], "fds_max_after": max(fs), "fds_end": fs[-1]}
    errors = [r for r in results if r["error"]]
    summary = {
        "mode": "fleet" if a.fleet else "serve", "workers": a.fleet, "streams": a.streams,
        "duration_s": a.duration, "max_tokens": a.max_tokens, "chaos": a.chaos,
        "chaos_events": len(events), "requests": len(results), "errors": len(errors),
        "error_kinds": sorted({e["error"][:80] for e in errors})[:20],
        "identity_checked": sum(1 for r in results if not r["error"]) if a.check_identity else 0,
        "mismatches": sum(1 for r in results if r["mismatch"]),
        "kv_blocks_active_before": kv_before, "kv_blocks_active_after": kv_after,
        "inflight_after": inflight_after, "migrated": migrated, "growth_after_warmup": growth,
        "warmup_s": warm, "final": final,
    }
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    json.dump({"samples": samples, "events": events, "results": results},
              open(os.path.join(out, "series.json"), "w"))
    write_html(os.path.join(out, "report.html"), summary, samples, events, procs)
    print(json.dumps({k: v for k, v in summary.items() if k != "final"}, indent=1))
    print(f"report: {out}/report.html")


def svg_chart(title, series, events, t_max, unit):
    """An inline SVG line chart of [(name, [(t, v)])] with event markers."""
    w, h, pad = 900, 220, 48
    vals = [v for _, pts in series for _, v in pts if v is not None]
    v_max = max(vals + [1e-9]) * 1.1
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
    x = lambda t: pad + (w - 2 * pad) * t / max(t_max, 1e-9)
    y = lambda v: h - pad + (pad * 2 - h) * v / v_max
    out = [f'<h3>{title}</h3><svg width="{w}" height="{h}" style="background:#fff;border:1px solid #ccc">']
    for e in events:
        out.append(f'<line x1="{x(e["t"]):.1f}" y1="{pad}" x2="{x(e["t"]):.1f}" y2="{h - pad}" '
                   f'stroke="#bbb" stroke-dasharray="3,3"><title>{e["what"]}</title></line>')
    out.append(f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#333"/>')
    out.append(f'<text x="4" y="{pad - 6}" font-size="11">{v_max:.1f} {unit}</text>')
    out.append(f'<text x="{w - pad - 40}" y="{h - pad + 16}" font-size="11">{t_max:.0f} s</text>')
    for k, (name, pts) in enumerate(series):
        c = colors[k % len(colors)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts if v is not None)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{pad + 10 + 120 * k}" y="{h - 8}" font-size="11" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_html(path, summary, samples, events, procs):
    t_max = samples[-1]["t"] if samples else 1
    def proc_series(key):
        return [(p.name, [(s["t"], s["procs"][p.name][key]) for s in samples]) for p in procs]
    rate = []
    for a_, b_ in zip(samples, samples[1:]):
        dt = b_["t"] - a_["t"]
        rate.append((b_["t"], (b_["done"] - a_["done"]) / dt if dt > 0 else None))
    charts = [
        svg_chart("RSS per process", proc_series("rss_mib"), events, t_max, "MiB"),
        svg_chart("Open file descriptors per process", proc_series("fds"), events, t_max, "fds"),
        svg_chart("Requests completed per second", [("requests/s", rate)], events, t_max, "/s"),
        svg_chart("Client-visible errors (cumulative)",
                  [("errors", [(s["t"], s["errors"]) for s in samples])], events, t_max, ""),
        svg_chart("KV blocks in use", [("kv blocks", [(s["t"], s["kv_active"]) for s in samples])],
                  events, t_max, "blocks"),
    ]
    rows = "".join(f"<tr><td>{k}</td><td><code>{json.dumps(v)}</code></td></tr>"
                   for k, v in summary.items())
    ev = "".join(f"<li>{e['t']:.1f} s: {e['what']}</li>" for e in events)
    html = (f"<!doctype html><meta charset=utf-8><title>kvx soak</title>"
            f"<body style='font-family:sans-serif;max-width:960px;margin:auto'>"
            f"<h1>kvx soak / chaos report</h1><table border=1 cellpadding=4>{rows}</table>"
            + "".join(charts) + f"<h3>Chaos events</h3><ul>{ev}</ul></body>")
    open(path, "w").write(html)


if __name__ == "__main__":
    main()
