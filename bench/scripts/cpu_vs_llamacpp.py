"""Summary of bench/scripts/cpu_vs_llamacpp.sh: medians per side and the kvx / llama.cpp ratios.

Usage: cpu_vs_llamacpp.py OUT_DIR RUNS "THREADS" KV_BUDGET_BYTES
"""

import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, unit=""):
    return "-" if x is None else f"{x:.1f}{unit}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def verdict(r, target, higher=True):
    if r is None:
        return "n/a"
    ok = r >= target if higher else r <= target
    return "PASS" if ok else "FAIL"


def llama_rate(doc, n_prompt, n_gen):
    for e in doc or []:
        if e.get("n_prompt") == n_prompt and e.get("n_gen") == n_gen:
            return e.get("avg_ts")
    return None


def main():
    out, runs, threads, kv_budget = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
    rows = []  # (test, kvx, llama, ratio, target, verdict, per-run ratios)

    for t in threads:
        kpp, ktg, lpp, ltg = [], [], [], []
        for r in range(1, runs + 1):
            k = load(f"{out}/kvx_engine.{t}.{r}.json")
            l = load(f"{out}/llama_engine.{t}.{r}.json")
            kpp.append(k and k.get("pp_tok_s"))
            ktg.append(k and k.get("tg_tok_s"))
            lpp.append(llama_rate(l, 512, 0))
            ltg.append(llama_rate(l, 0, 128))
        if not any(kpp) and not any(lpp):
            continue
        runs_pp = [ratio(a, b) for a, b in zip(kpp, lpp)]
        runs_tg = [ratio(a, b) for a, b in zip(ktg, ltg)]
        r_pp, r_tg = ratio(med(kpp), med(lpp)), ratio(med(ktg), med(ltg))
        if t == "2":
            rows.append((f"pp512 tok/s, {t} threads", med(kpp), med(lpp), r_pp, 3.0, verdict(r_pp, 3.0), runs_pp))
        else:
            rows.append((f"pp512 tok/s, {t} thread(s)", med(kpp), med(lpp), r_pp, None, "", runs_pp))
        rows.append((f"tg128 tok/s, {t} thread(s)", med(ktg), med(ltg), r_tg, 1.5, verdict(r_tg, 1.5), runs_tg))

    # kvx serve's one stream: its decode rate, 1000 / mean time per output token (ms); and
    # the same on a server that does not lend idle cores (`--no-lend-cores`).
    def one_stream(name):
        rates = []
        for r in range(1, runs + 1):
            doc = load(f"{out}/{name}.{r}.json")
            run = (doc or {}).get("runs", [{}])[0] if doc else {}
            tpot = ((run.get("latency_ms") or {}).get("tpot") or {}).get("mean")
            rates.append(1000.0 / tpot if tpot else None)
        return rates
    one, one_nolend = one_stream("kvx_serve_one"), one_stream("kvx_serve_one_nolend")
    ks, ls = [], []
    for r in range(1, runs + 1):
        for side, acc in (("kvx_serve", ks), ("llama_serve", ls)):
            doc = load(f"{out}/{side}.{r}.json")
            hwm = None
            try:
                with open(f"{out}/{side}.{r}.json.hwm_kb") as f:
                    hwm = int(f.read().strip()) * 1024
            except (OSError, ValueError):
                pass
            run = (doc or {}).get("runs", [{}])[0] if doc else {}
            acc.append({
                "tps": run.get("throughput", {}).get("output_tokens_per_s"),
                "ttft": run.get("latency_ms", {}).get("ttft", {}).get("p50"),
                "tpot": ((run.get("latency_ms") or {}).get("tpot") or {}).get("mean"),
                "failed": run.get("requests", {}).get("failed"),
                "out_tokens": run.get("tokens", {}).get("output_total"),
                "hwm": hwm,
            })
    if any(x["tps"] for x in ks + ls):
        k_tps, l_tps = med([x["tps"] for x in ks]), med([x["tps"] for x in ls])
        r_tps = ratio(k_tps, l_tps)
        rows.append(("serve 16 streams, output tok/s", k_tps, l_tps, r_tps, 5.0, verdict(r_tps, 5.0),
                     [ratio(a["tps"], b["tps"]) for a, b in zip(ks, ls)]))
        if any(one):
            r_one = ratio(k_tps, med(one))
            rows.append(("kvx serve 16 streams / 1 stream's decode, tok/s", k_tps, med(one), r_one, 4.0,
                         verdict(r_one, 4.0), [ratio(a["tps"], b) for a, b in zip(ks, one)]))
            # For reading the one above (no target): the 16 streams' decode alone, 16 / mean
            # time per output token, without their prompts' time and the run's ramp and tail.
            dec = [16000.0 / x["tpot"] if x["tpot"] else None for x in ks]
            rows.append(("kvx serve 16 streams' decode (16 / mean TPOT) / 1 stream's, tok/s",
                         med(dec), med(one), ratio(med(dec), med(one)), None, "",
                         [ratio(a, b) for a, b in zip(dec, one)]))
        if any(one_nolend):
            # Also for reading the scaling row (no target): the one stream of a server that
            # keeps each shard on its own core, as the 16 streams' shards are.
            rows.append(("kvx serve 16 streams / 1 stream's decode with --no-lend-cores, tok/s",
                         k_tps, med(one_nolend), ratio(k_tps, med(one_nolend)), None, "",
                         [ratio(a["tps"], b) for a, b in zip(ks, one_nolend)]))
        k_ttft, l_ttft = med([x["ttft"] for x in ks]), med([x["ttft"] for x in ls])
        r_ttft = ratio(k_ttft, l_ttft)
        rows.append(("serve TTFT p50 ms (lower wins)", k_ttft, l_ttft, r_ttft, 1.0,
                     verdict(r_ttft, 1.0 - 1e-9, higher=False),
                     [ratio(a["ttft"], b["ttft"]) for a, b in zip(ks, ls)]))
        k_rss, l_rss = med([x["hwm"] for x in ks]), med([x["hwm"] for x in ls])
        mib = lambda b: None if b is None else b / 2**20
        ok = None if k_rss is None or l_rss is None else k_rss <= l_rss + kv_budget
        rows.append((f"serve peak RSS MiB (<= llama + KV {kv_budget / 2**20:.0f})", mib(k_rss), mib(l_rss),
                     ratio(k_rss, l_rss), None, "n/a" if ok is None else ("PASS" if ok else "FAIL"), []))
        bad = [x for x in ks + ls if x["failed"]]
        if bad:
            print(f"warning: {len(bad)} serving runs had failed requests", file=sys.stderr)

    print(f"| test | kvx | llama.cpp | kvx/llama.cpp | target | verdict | per-run ratios |")
    print("|---|---|---|---|---|---|---|")
    for name, k, l, r, target, v, per in rows:
        tgt = "" if target is None else (f">= {target:g}x" if "TTFT" not in name else "< 1x")
        # The scaling row's columns are kvx's 16 streams and kvx's one stream.
        per_s = " ".join(fmt(p, "x") if p is not None else "-" for p in per)
        print(f"| {name} | {fmt(k)} | {fmt(l)} | {fmt(r, 'x')} | {tgt} | {v} | {per_s} |")
    arith_file = os.path.join(out, "kvx_arithmetic.txt")
    arith = open(arith_file).read().strip() if os.path.exists(arith_file) else "unknown arithmetic"
    print(f"\nkvx in the {arith}; medians of {runs} alternating runs; raw results in "
          f"{os.path.abspath(out)}")


if __name__ == "__main__":
    main()
