#!/usr/bin/env python3
"""Summarizes alternating kvx bench / aiperf runs: medians of each tool and their ratio.

Usage: aiperf_summary.py OUT_DIR   (reads OUT_DIR/kvx_*.json and OUT_DIR/aiperf_*/profile_export_aiperf.json)
Prints a Markdown table and exits non-zero if a headline metric differs by more than 5%.
"""
import glob
import json
import statistics
import sys


def kvx_metrics(path):
    run = json.load(open(path))["runs"][0]
    lat = run["latency_ms"]
    return {
        "TTFT p50 (ms)": lat["ttft"]["p50"],
        "TTFT p90 (ms)": lat["ttft"]["p90"],
        "ITL p50 (ms)": lat["itl"]["p50"],
        "TPOT p50 (ms) [aiperf ITL]": lat["tpot"]["p50"],
        "output tok/s": run["throughput"]["output_tokens_per_s"],
        "requests/s": run["throughput"]["requests_per_s"],
    }


def aiperf_metrics(path):
    d = json.load(open(path))
    return {
        "TTFT p50 (ms)": d["time_to_first_token"]["p50"],
        "TTFT p90 (ms)": d["time_to_first_token"]["p90"],
        "ITL p50 (ms)": d["inter_token_latency"]["p50"],
        "TPOT p50 (ms) [aiperf ITL]": d["inter_token_latency"]["p50"],
        "ICL p50 (ms) [every gap]": d["inter_chunk_latency"]["p50"],
        "output tok/s": d["output_token_throughput"]["avg"],
        "requests/s": d["request_throughput"]["avg"],
    }


def main():
    out = sys.argv[1]
    kvx = [kvx_metrics(p) for p in sorted(glob.glob(f"{out}/kvx_*.json"))]
    aip = [aiperf_metrics(p) for p in sorted(glob.glob(f"{out}/aiperf_*/profile_export_aiperf.json"))]
    if not kvx or not aip:
        sys.exit("no runs found")
    # kvx's every-gap ITL corresponds to aiperf's inter-chunk latency.
    for k in kvx:
        k["ICL p50 (ms) [every gap]"] = k["ITL p50 (ms)"]
    headline = ["TTFT p50 (ms)", "TTFT p90 (ms)", "ITL p50 (ms)", "output tok/s"]
    rows = headline + ["TPOT p50 (ms) [aiperf ITL]", "ICL p50 (ms) [every gap]", "requests/s"]
    print(f"runs: kvx {len(kvx)}, aiperf {len(aip)} (medians)\n")
    print("| metric | kvx bench | aiperf | kvx/aiperf | within 5% |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for m in rows:
        a = statistics.median(r[m] for r in kvx)
        b = statistics.median(r[m] for r in aip)
        ratio = a / b if b else float("nan")
        ok = abs(ratio - 1) <= 0.05
        if m in headline:
            worst = max(worst, abs(ratio - 1))
        print(f"| {m} | {a:.3f} | {b:.3f} | {ratio:.3f} | {'yes' if ok else 'NO'} |")
    print("\nper run (kvx then aiperf):")
    for name, runs in (("kvx", kvx), ("aiperf", aip)):
        for i, r in enumerate(runs):
            print(f"  {name}[{i}] " + ", ".join(f"{k.split(' (')[0]}={v:.2f}" for k, v in r.items()))
    sys.exit(0 if worst <= 0.05 else 1)


if __name__ == "__main__":
    main()
