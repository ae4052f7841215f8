#!/usr/bin/env python3
"""Slow and broken clients against `kvx serve` (real model): 16 normal streams (`kvx bench`,
closed loop) alone, then again while 200 slowloris connections dribble header bytes and 50
streams read their first events and then stop reading. Prints the normal streams' ITL p99 in
both runs and their ratio, how long the slowloris connections were held, how many stalled
streams the server cut (`kvx_streams_cut_total`), and the KV blocks in use afterwards (0: the
stalled streams hold nothing).

Usage: bench/scripts/slow_clients.py [--duration 60] [--stall-max-tokens 2000] [-- SERVE FLAGS]
Environment: KVX (default target/release/kvx), KVX_TEST_MODEL (the GGUF; default model).
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVX = os.environ.get("KVX", os.path.join(ROOT, "target/release/kvx"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port, series):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/metrics")
        for line in c.getresponse().read().decode().splitlines():
            name, _, v = line.rpartition(" ")
            if name == series:
                return float(v)
    except OSError:
        return None
    finally:
        c.close()
    return None


def bench(port, secs, out):
    subprocess.run([KVX, "bench", "--url", f"http://127.0.0.1:{port}", "--concurrency", "16",
                    "--duration", str(secs), "--input-tokens", "128", "--output-tokens", "128",
                    "--ignore-eos", "-q", "--json", out], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = json.load(open(out))["runs"][0]
    return r["latency_ms"]["itl"]["p99"], r["requests"]


def slowloris(port, held, stop):
    """Sends a header byte a second until the server closes the connection."""
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.time()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\n")
    s.settimeout(1.0)
    try:
        while not stop.is_set():
            s.sendall(b"X")
            try:
                if s.recv(4096) == b"":
                    break
            except socket.timeout:
                pass
    except OSError:
        pass
    held.append(time.time() - t0)
    s.close()


def stalled(port, max_tokens, socks):
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 2:
        d = s.recv(4096)
        if not d:
            break
        got += d
    socks.append(s)  # never read again


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=60)
    ap.add_argument("--stall-max-tokens", type=int, default=2000)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="kvx-slow-")
    port = free_port()
    model = os.environ.get("KVX_TEST_MODEL")
    args = [KVX, "serve", "--port", str(port)] + (["--model", model] if model else []) + a.serve_args
    srv = subprocess.Popen(args, stdout=open(f"{out}/serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if metric(port, "kvx_kv_blocks_active") is not None:
                break
            time.sleep(0.1)
        bench(port, 10, f"{out}/warm.json")
        quiet, qreq = bench(port, a.duration, f"{out}/quiet.json")
        held, socks, stop = [], [], threading.Event()
        lor = [threading.Thread(target=slowloris, args=(port, held, stop)) for _ in range(200)]
        for t in lor:
            t.start()
        st = [threading.Thread(target=stalled, args=(port, a.stall_max_tokens, socks))
              for _ in range(50)]
        for t in st:
            t.start()
        for t in st:
            t.join()
        loaded, lreq = bench(port, a.duration, f"{out}/loaded.json")
        t_end = time.time()
        kv = metric(port, "kvx_kv_blocks_active")
        while kv and time.time() - t_end < 120:
            time.sleep(1)
            kv = metric(port, "kvx_kv_blocks_active")
        cut = metric(port, 'kvx_streams_cut_total{reason="unread"}') or 0.0
        kv = kv if kv is not None else float("nan")
        stop.set()
        for t in lor:
            t.join()
        held.sort()
        print(f"normal streams (16): ITL p99 quiet {quiet:.1f} ms, with slow clients {loaded:.1f} ms"
              f" -> ratio {loaded / quiet:.2f} (bar <= 1.5); requests {qreq} / {lreq}")
        print(f"slowloris (200): held {held[0]:.1f}-{held[-1]:.1f} s (median {held[len(held) // 2]:.1f})")
        print(f"stalled streams (50): {cut:.0f} cut for unread bytes; KV blocks in use after: {kv:.0f}"
              f" ({time.time() - t_end:.0f} s after the loaded run)")
        for s in socks:
            s.close()
    finally:
        srv.terminate()
        srv.wait()
    print(f"reports in {out}")


if __name__ == "__main__":
    sys.exit(main())
