//! `kvx serve` with two model shards on their own cores: a lone request's steps also run on
//! the idle shard's core (that shard's guest thread in the busy shard's kernel pool does part
//! of the work), and its tokens are the ones the busy shard computes alone
//! (`--no-lend-cores`, which starts no guest threads).

use kvx_e2e::serve::{Endpoint, Served};
use serde_json::{Value, json};

/// CPU time (clock ticks) of the server's guest kernel threads, and how many there are.
fn guest_ticks(s: &Served) -> (usize, u64) {
    let dir = format!("/proc/{}/task", s.pid());
    let mut n = 0;
    let mut ticks = 0;
    for task in std::fs::read_dir(&dir).expect("reading the server's threads").flatten() {
        let p = task.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comm.starts_with("kvx-guest") {
            continue;
        }
        n += 1;
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        ticks += field(14) + field(15);
    }
    (n, ticks)
}

fn complete(s: &Served) -> String {
    let name = s.get("/v1/models").json()["data"][0]["id"].as_str().expect("model id").to_string();
    let prompt = "The history of the printing press begins with block printing in East Asia, \
                  then movable type, and then Gutenberg's press in Mainz. Tell the story:";
    let r = s.post(
        "/v1/completions",
        &json!({"model": name, "prompt": prompt, "max_tokens": 160, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 160, "{v}");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

#[test]
fn a_lone_request_runs_on_the_idle_shards_core_with_the_same_tokens() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: two pinned shards need two cores (found {cores})");
        return;
    }
    // A small cache: the servers fault their pools in at start.
    let small = ["--engine", "model", "--shards", "2", "--kv-cache-bytes", "67108864"];
    let lent = Served::start(&small);
    let (guests, before) = guest_ticks(&lent);
    assert_eq!(guests, 2, "one guest per shard, on the other shard's core");
    let text = complete(&lent);
    let (_, after) = guest_ticks(&lent);
    assert!(
        after > before,
        "the idle shard's core computed none of a lone request's steps ({before} → {after} ticks)"
    );
    eprintln!("guest ticks over the request: {}", after - before);

    let own = Served::start(&[&small[..], &["--no-lend-cores"]].concat());
    assert_eq!(guest_ticks(&own).0, 0, "--no-lend-cores starts no guest threads");
    assert_eq!(complete(&own), text, "lending a core changed the tokens");
}
