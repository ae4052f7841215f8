//! KV tiers below the engine's pool with the real model: a prompt pushed out of the pool comes
//! back from host memory with the same answer and counts as cached; the disk tier survives a
//! restart; a corrupted block on disk is computed instead, with the same answer; a disk that
//! fills stops offload to disk and serving goes on; the router sends a prefix that only one
//! worker holds, in host memory, to that worker.

use std::time::{Duration, Instant};

use kvx_e2e::serve::{Endpoint, Served};
use serde_json::{Value, json};

fn prompt(len: u32, seed: u32) -> Vec<u32> {
    (0..len).map(|j| 200 + (seed * 7919 + j * 104_729) % 40_000).collect()
}

/// A greedy completion: `(text and top-5 log-probabilities, cached prompt tokens)`.
fn complete(s: &Served, prompt: &[u32]) -> (Value, u64) {
    let body = json!({ "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5 });
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (json!({ "text": c["text"], "logprobs": c["logprobs"] }), cached)
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < end, "{what}: not within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tier(s: &Served, name: &str, worker: u32, tier: &str) -> f64 {
    s.metric(&format!("kvx_worker_kv_{name}{{worker=\"{worker}\",tier=\"{tier}\"}}")).unwrap_or(0.0)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvx-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A 16 MiB pool (45 blocks of 16 tokens) holds one 600-token prompt at a time.
#[test]
fn a_prompt_pushed_out_of_the_pool_comes_back_from_host_memory() {
    let s = Served::start(&[
        "--shards",
        "1",
        "--kv-cache-bytes",
        "16777216",
        "--kv-host-bytes",
        "268435456",
    ]);
    let (a, b) = (prompt(600, 1), prompt(600, 2));
    let (first, cached) = complete(&s, &a);
    assert_eq!(cached, 0);
    complete(&s, &b); // pushes most of `a` out of the pool
    let (again, cached) = complete(&s, &a);
    assert_eq!(again, first, "the same answer from loaded blocks");
    assert_eq!(cached, 592, "every full block before the last prompt token counts as cached");
    let onboarded = tier(&s, "onboard_blocks_total", 1, "host");
    assert!(onboarded >= 20.0, "blocks came from host memory ({onboarded})");
    assert!(tier(&s, "offload_blocks_total", 1, "host") >= 74.0);
    assert!(
        s.metric("kvx_worker_kv_onboard_bytes_total{worker=\"1\",tier=\"host\"}").unwrap_or(0.0)
            > 1e6
    );
}

/// Serves `prompt` once on a server with a disk tier in `dir` (and `extra` flags) and stops
/// it once every block of it is on disk; returns the answer.
fn write_to_disk(dir: &std::path::Path, p: &[u32], extra: &[&str]) -> Value {
    let d = dir.to_string_lossy().into_owned();
    let mut args = vec!["--shards", "1", "--kv-disk", &d];
    args.extend_from_slice(extra);
    let mut s = Served::start(&args);
    let (answer, _) = complete(&s, p);
    let blocks = (p.len() / 16) as f64;
    wait_for("the blocks on disk", || tier(&s, "offload_blocks_total", 1, "disk") >= blocks);
    s.terminate();
    assert!(s.wait_exit(Duration::from_secs(30)).is_some(), "the server stopped");
    answer
}

#[test]
fn a_restarted_server_loads_a_prompt_from_its_disk_tier() {
    let dir = temp_dir("restart");
    let p = prompt(1000, 3);
    let cold = write_to_disk(&dir, &p, &[]);
    let s = Served::start(&["--shards", "1", "--kv-disk", &dir.to_string_lossy()]);
    assert!(tier(&s, "tier_blocks", 1, "disk") >= 62.0, "the disk tier came back");
    let (warm, cached) = complete(&s, &p);
    assert_eq!(warm, cold, "the same answer after the restart");
    assert_eq!(cached, 992, "every full block before the last prompt token from disk");
    assert!(tier(&s, "onboard_blocks_total", 1, "disk") >= 62.0);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupted_block_on_disk_is_computed_and_the_answer_stays() {
    use std::os::unix::fs::FileExt;
    let dir = temp_dir("corrupt");
    let p = prompt(400, 4);
    let cold = write_to_disk(&dir, &p, &[]);
    // Flip a byte in the values of the 11th block written (slot 10: header, keys, values,
    // each 184,320 bytes for this model).
    let f = std::fs::OpenOptions::new().read(true).write(true).open(dir.join("w1.blocks")).unwrap();
    let stride = 4096 + 2 * 184_320u64;
    let at = 10 * stride + 4096 + 184_320 + 777;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
    drop(f);
    let s = Served::start(&["--shards", "1", "--kv-disk", &dir.to_string_lossy()]);
    let (warm, cached) = complete(&s, &p);
    assert_eq!(warm, cold, "the corrupted block and those after it are computed");
    assert_eq!(cached, 160, "the ten blocks before it come from disk");
    assert_eq!(s.metric("kvx_worker_kv_checksum_failures_total{worker=\"1\"}"), Some(1.0));
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 16 MiB filesystem under a disk tier of 64 MiB: it fills after about forty blocks.
#[test]
fn a_disk_that_fills_stops_offload_to_it_and_serving_goes_on() {
    let dir = temp_dir("full");
    std::fs::create_dir_all(&dir).unwrap();
    let mount = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16m", "tmpfs"])
        .arg(&dir)
        .status()
        .expect("running mount");
    assert!(mount.success(), "mounting a small tmpfs (the tests run as root)");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // The kernel lets go of a dead process's io_uring files a moment after it exits.
            let umount = || std::process::Command::new("umount").arg(&self.0).status();
            let end = Instant::now() + Duration::from_secs(5);
            while !umount().is_ok_and(|s| s.success()) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _unmount = Unmount(dir.clone());
    let d = dir.to_string_lossy().into_owned();
    let s = Served::start(&["--shards", "1", "--kv-disk", &d, "--kv-disk-bytes", "67108864"]);
    let mut answers = Vec::new();
    for i in 0..8 {
        answers.push(complete(&s, &prompt(300, 10 + i)).0);
    }
    wait_for("offload to disk stopped", || {
        s.metric("kvx_worker_kv_disk_offload_stopped{worker=\"1\"}") == Some(1.0)
    });
    assert!(s.metric("kvx_worker_kv_disk_errors_total{worker=\"1\"}").unwrap_or(0.0) >= 1.0);
    let on_disk = tier(&s, "tier_blocks", 1, "disk");
    assert!((1.0..=44.0).contains(&on_disk), "what fitted stays: {on_disk} blocks");
    // Serving goes on, with the same answers.
    for i in 0..8 {
        assert_eq!(complete(&s, &prompt(300, 10 + i)).0, answers[i as usize]);
    }
}

/// Two shards with 16 MiB pools and host tiers. A 400-token prefix lands on one shard (the
/// other one is busy), is pushed out of every pool, and while that shard runs a long request
/// of its own, a request extending the prefix still goes to it — its host memory holds the
/// prefix; without the tier's credit the idle shard would be cheaper.
#[test]
fn the_router_sends_a_prefix_held_in_host_memory_to_its_holder() {
    let s = Served::start(&[
        "--shards",
        "2",
        "--kv-cache-bytes",
        "16777216",
        "--kv-host-bytes",
        "268435456",
    ]);
    let count = |what: &str, w: u32| {
        s.metric(&format!("kvx_worker_{what}{{worker=\"{w}\"}}")).unwrap_or(0.0)
    };
    let finished = |w: u32| count("requests_finished_total", w);
    let running = |w: u32| count("running_requests", w);
    // The shard that finished one more request than `before` (counters are published a
    // moment after the response).
    let which = |before: [f64; 2]| {
        let mut on = 0;
        wait_for("a finished request counted", || {
            on = if finished(1) > before[0] {
                1
            } else if finished(2) > before[1] {
                2
            } else {
                0
            };
            on != 0
        });
        on
    };
    // Nothing running on either shard (a finished request's counters published).
    let idle = || wait_for("both shards idle", || running(1) == 0.0 && running(2) == 0.0);
    // A long request in the background; returns the shard it runs on.
    let addr = s.addr.clone();
    let mut seed = 0;
    let mut long = || {
        seed += 1;
        let (addr, p) = (addr.clone(), prompt(64, 90_000 + seed));
        let before = [running(1), running(2)];
        let t = std::thread::spawn(move || {
            let body =
                json!({ "prompt": p, "max_tokens": 300, "temperature": 0, "ignore_eos": true });
            let r = kvx_e2e::serve::http(
                &addr,
                "POST",
                "/v1/completions",
                &[],
                Some(body.to_string().as_bytes()),
            );
            assert_eq!(r.status, 200, "{}", r.text());
        });
        let mut on = 0;
        wait_for("the long request running", || {
            on = if running(1) > before[0] {
                1
            } else if running(2) > before[1] {
                2
            } else {
                0
            };
            on != 0
        });
        (t, on)
    };
    for k in 0..2u32 {
        let prefix = prompt(400, 100 + k);
        let (busy, busy_on) = long();
        let before = [finished(1), finished(2)];
        complete(&s, &prefix);
        let holder = which(before);
        assert_ne!(holder, busy_on, "the prefix went to the idle shard");
        busy.join().unwrap();
        idle();
        // Push it out of both pools (45 blocks each): unrelated 600-token prompts until each
        // shard has taken two.
        let start = [finished(1), finished(2)];
        let mut j = 0;
        while finished(1) < start[0] + 2.0 || finished(2) < start[1] + 2.0 {
            assert!(j < 16, "the unrelated prompts never reached both shards");
            let before = [finished(1), finished(2)];
            complete(&s, &prompt(600, 1000 + 20 * k + j));
            which(before);
            j += 1;
        }
        // The holder runs a long request of its own.
        let mut jobs = Vec::new();
        loop {
            let (t, on) = long();
            jobs.push(t);
            if on == holder {
                break;
            }
            assert!(jobs.len() < 3, "no long request reached the holder");
        }
        let mut longer = prefix.clone();
        longer.extend(prompt(40, 5000 + k));
        let before = [finished(1), finished(2)];
        let (_, cached) = complete(&s, &longer);
        let went = which(before);
        assert_eq!(went, holder, "prefix {k}: the request went to the shard without it");
        assert!(cached >= 384, "prefix {k}: {cached} tokens cached");
        for t in jobs {
            t.join().unwrap();
        }
        // Their counters come a moment after their responses: counted before the next
        // `which` compares counts.
        idle();
    }
    let loaded =
        tier(&s, "onboard_blocks_total", 1, "host") + tier(&s, "onboard_blocks_total", 2, "host");
    assert!(loaded >= 40.0, "the prefixes came from host memory ({loaded} blocks)");
}
