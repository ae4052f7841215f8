#!/usr/bin/env python3
"""NIXL peer benchmark (DRAM to DRAM between two processes, UCX backend by default).

Runs the same shape as `kvx bench xfer`: a pool of BLOCKS blocks of BLOCK bytes on each
side, transfers of BATCH blocks (block i <-> remote block i), INFLIGHT transfers posted,
SECS measured seconds. Metadata is exchanged through files in --dir.

  nixl_bench.py target    --dir D --block B --blocks N
  nixl_bench.py initiator --dir D --block B --blocks N --batch K --inflight Q --secs S --op WRITE
                          [--threads T]

The initiator prints one line: "nixl op=WRITE block=B batch=K gbps=X".
"""
import argparse
import os
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config


def wait_file(path, timeout=60.0):
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.01)
    time.sleep(0.05)
    with open(path, "rb") as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["target", "initiator"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--block", type=int, default=65536)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0,
                    help="UCX backend threads (nixl_agent_config num_threads; 0 = its default)")
    ap.add_argument("--op", default="WRITE", choices=["WRITE", "READ"])
    a = ap.parse_args()

    pool = a.block * a.blocks
    buf = np.ones(pool, dtype=np.uint8)
    agent = nixl_agent(a.role, nixl_agent_config(backends=["UCX"], num_threads=a.threads))
    agent.register_memory([(buf.ctypes.data, pool, 0, "")], "DRAM")

    if a.role == "target":
        with open(os.path.join(a.dir, "target.addr.tmp"), "w") as f:
            f.write(str(buf.ctypes.data))
        os.rename(os.path.join(a.dir, "target.addr.tmp"), os.path.join(a.dir, "target.addr"))
        with open(os.path.join(a.dir, "target.md.tmp"), "wb") as f:
            f.write(agent.get_agent_metadata())
        os.rename(os.path.join(a.dir, "target.md.tmp"), os.path.join(a.dir, "target.md"))
        peer = agent.add_remote_agent(wait_file(os.path.join(a.dir, "initiator.md")))
        while True:
            notifs = agent.get_new_notifs()
            if any(b"done" in m for ms in notifs.values() for m in ms):
                break
            time.sleep(0.01)
        # NIXL 1.5 may crash in interpreter teardown; the run is over, skip it.
        os._exit(0)

    with open(os.path.join(a.dir, "initiator.md.tmp"), "wb") as f:
        f.write(agent.get_agent_metadata())
    os.rename(os.path.join(a.dir, "initiator.md.tmp"), os.path.join(a.dir, "initiator.md"))
    remote_base = int(wait_file(os.path.join(a.dir, "target.addr")))
    peer = agent.add_remote_agent(wait_file(os.path.join(a.dir, "target.md")))
    local = [(buf.ctypes.data + i * a.block, a.block, 0) for i in range(a.blocks)]
    remote = [(remote_base + i * a.block, a.block, 0) for i in range(a.blocks)]
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    rh = agent.prep_xfer_dlist(peer, remote, "DRAM")
    # Wait for the connection (metadata exchange is asynchronous).
    t0 = time.time()
    while True:
        try:
            nx = a.blocks // a.batch
            handles = [
                agent.make_prepped_xfer(
                    a.op, lh, list(range(i * a.batch, (i + 1) * a.batch)),
                    rh, list(range(i * a.batch, (i + 1) * a.batch)))
                for i in range(nx)
            ]
            break
        except Exception:
            if time.time() - t0 > 30:
                raise
            time.sleep(0.05)

    def drive(secs):
        done = 0
        nxt = 0
        inflight = []
        start = time.time()
        while True:
            while len(inflight) < a.inflight and time.time() - start < secs:
                h = handles[nxt]
                nxt = (nxt + 1) % len(handles)
                st = agent.transfer(h)
                if st == "ERR":
                    sys.exit("nixl transfer error")
                inflight.append(h)
            if not inflight:
                break
            h = inflight[0]
            st = agent.check_xfer_state(h)
            if st == "DONE":
                inflight.pop(0)
                done += 1
            elif st == "ERR":
                sys.exit("nixl transfer error")
        return done, time.time() - start

    drive(a.warmup)
    done, el = drive(a.secs)
    gbps = done * a.batch * a.block / el / 1e9
    print(f"nixl op={a.op} block={a.block} batch={a.batch} gbps={gbps:.3f}", flush=True)
    agent.send_notif(peer, b"done")
    time.sleep(0.2)
    os._exit(0)


if __name__ == "__main__":
    main()
