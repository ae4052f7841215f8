//! `kvx eval perplexity` against llama.cpp: the same text, windows and scoring as
//! llama-perplexity (computed by the oracle on llama.cpp's logits) give the same perplexity to
//! four significant digits, over the same number of scored tokens; bad arguments are errors;
//! `--save-logits` / `--kl-divergence` measure one arithmetic against another, and
//! `--kld-values` gives the per-token divergences behind the mean.

use std::io::Write;
use std::process::{Command, Stdio};

use kvx_e2e::{kvx, kvx_ok, oracle_python, root, test_model};
use serde_json::{Value, json};

const TEXT: &str = "The history of the printing press begins in the fifteenth century, when \
    Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press adapted \
    from those used for wine. Within fifty years presses operated in more than two hundred \
    cities across Europe, and the price of books fell so far that reading spread from monks \
    and scholars to merchants, craftsmen and their families. Pamphlets, newspapers and \
    scientific journals followed, and ideas moved faster than ever before. Rivers carried \
    the paper, mills along their banks beat rags into pulp, and printers settled where trade \
    routes crossed, so that Venice, Antwerp and Lyon became capitals of the new craft. ";

fn oracle_perplexity(text: &str, ctx: usize) -> Value {
    let mut child = Command::new(oracle_python())
        .arg(root().join("tests/oracle/oracle.py"))
        .args(["perplexity", "--model"])
        .arg(test_model())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("oracle");
    let req = json!({"text": text, "ctx": ctx});
    child.stdin.take().expect("stdin").write_all(format!("{req}\n").as_bytes()).expect("write");
    let out = child.wait_with_output().expect("oracle output");
    assert!(out.status.success(), "oracle failed");
    serde_json::from_slice(&out.stdout).expect("oracle json")
}

#[test]
fn perplexity_matches_llama_perplexity() {
    let dir = std::env::temp_dir().join(format!("kvx-eval-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("text.txt");
    // Three paraphrases' worth of text: windows that differ.
    let text = format!("{TEXT}{}{}", TEXT.replace("press", "machine"), TEXT.to_uppercase());
    std::fs::write(&file, &text).expect("write");
    let path = file.to_str().expect("path");
    for ctx in [128usize, 256] {
        let want = oracle_perplexity(&text, ctx);
        let out = kvx_ok(&[
            "eval",
            "perplexity",
            "--exact",
            "--file",
            path,
            "--ctx",
            &ctx.to_string(),
            "--json",
        ]);
        let got: Value = serde_json::from_str(out.trim()).expect("kvx json");
        assert_eq!(got["tokens"], want["tokens"], "ctx {ctx}: {got} vs {want}");
        assert_eq!(got["chunks"], want["chunks"], "ctx {ctx}");
        assert!(got["chunks"].as_u64().is_some_and(|c| c >= 1), "{got}");
        let (a, b) = (got["ppl"].as_f64().expect("ppl"), want["ppl"].as_f64().expect("ppl"));
        assert!(a > 1.0 && a < 1000.0, "{a}");
        assert!((a - b).abs() / b < 5e-5, "ctx {ctx}: kvx {a} vs llama.cpp {b}");
    }
    // Too short a text, and a batch kvx cannot follow, are errors.
    let short = dir.join("short.txt");
    std::fs::write(&short, "Hello.").expect("write");
    let out = kvx(&["eval", "perplexity", "--file", short.to_str().expect("path")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fewer than one window"));
    let out = kvx(&["eval", "perplexity", "--file", path, "--ctx", "1024", "--batch", "256"]);
    assert!(!out.status.success());

    // KL divergence against a saved base: the exact arithmetic's rows compare equal to
    // themselves; the fast arithmetic's sit a small, nonzero distance away with the same
    // most likely tokens nearly everywhere; a base of another window is refused.
    let base = dir.join("exact.logp");
    let base = base.to_str().expect("path");
    let run = |extra: &[&str]| -> Value {
        let mut a = vec!["eval", "perplexity", "--file", path, "--ctx", "128", "--json"];
        a.extend_from_slice(extra);
        serde_json::from_str(kvx_ok(&a).trim()).expect("json")
    };
    let saved = run(&["--save-logits", base, "--exact"]);
    assert!(saved.get("kld_mean").is_none(), "{saved}");
    let same = run(&["--kl-divergence", base, "--arith", "exact"]);
    assert_eq!((same["kld_max"].as_f64(), same["top1"].as_f64()), (Some(0.0), Some(1.0)), "{same}");
    assert_eq!(same["ppl"], saved["ppl"]);
    let fast = run(&["--kl-divergence", base, "--arith", "fast"]);
    let kld = fast["kld_mean"].as_f64().expect("kld");
    // Where the CPU has no row-lane kernels `fast` is `exact` (and says so).
    match fast["arith"].as_str() {
        Some("fast") => assert!(kld > 0.0 && kld < 0.01, "{fast}"),
        _ => assert_eq!((fast["arith"].as_str(), kld), (Some("exact"), 0.0), "{fast}"),
    }
    assert!(fast["top1"].as_f64().expect("top1") > 0.9, "{fast}");
    assert!(
        (fast["ppl_base"].as_f64().expect("base") / saved["ppl"].as_f64().expect("ppl") - 1.0)
            .abs()
            < 1e-5
    );
    // `split` through the binary: its own name, a small distance from exact's rows.
    // Each scored token's divergence with `--kld-values`: one f64 per token, whose mean and
    // maximum are the run's; without a base it is refused.
    let values = dir.join("split.kld");
    let values = values.to_str().expect("path");
    let split = run(&["--kl-divergence", base, "--arith", "split", "--kld-values", values]);
    assert_eq!(split["arith"].as_str(), Some("split"), "{split}");
    let kld = split["kld_mean"].as_f64().expect("kld");
    assert!(kld > 0.0 && kld < 0.01 && split["top1"].as_f64().expect("top1") > 0.9, "{split}");
    let per: Vec<f64> = std::fs::read(values)
        .expect("values")
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    assert_eq!(Some(per.len() as u64), split["tokens"].as_u64(), "{split}");
    let mean = per.iter().sum::<f64>() / per.len() as f64;
    assert!((mean - kld).abs() <= 1e-12 * kld, "{mean} vs {split}");
    assert_eq!(Some(per.iter().copied().fold(0.0, f64::max)), split["kld_max"].as_f64());
    let out = kvx(&["eval", "perplexity", "--file", path, "--kld-values", values]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("kl-divergence")
    );
    // The default arithmetic is this CPU's choice for the model: `split` where its `fast`
    // products pay, else `exact`; either way it names itself, and only `exact` is at zero.
    let auto = run(&["--kl-divergence", base]);
    match auto["arith"].as_str() {
        Some("split") => assert_eq!(auto["kld_mean"], split["kld_mean"], "{auto}"),
        _ => assert_eq!(
            (auto["arith"].as_str(), auto["kld_max"].as_f64()),
            (Some("exact"), Some(0.0))
        ),
    }
    // `--exact` is `--arith exact`, over any `--arith` (a service's `KVX_ARITH` included);
    // with `--fast-math` it is a contradiction.
    let over = run(&["--kl-divergence", base, "--exact", "--arith", "split"]);
    assert_eq!((over["arith"].as_str(), over["kld_max"].as_f64()), (Some("exact"), Some(0.0)));
    let out = kvx(&["eval", "perplexity", "--file", path, "--exact", "--fast-math"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("give one"));
    let one = run(&["--chunks", "1"]);
    assert_eq!(one["chunks"], 1);
    let out = kvx(&[
        "eval",
        "perplexity",
        "--file",
        path,
        "--save-logits",
        base,
        "--kl-divergence",
        base,
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("erase the base"));
    let intact = run(&["--kl-divergence", base, "--exact"]);
    assert_eq!(intact["kld_max"].as_f64(), Some(0.0), "the base is intact");
    let out = kvx(&["eval", "perplexity", "--file", path, "--ctx", "64", "--kl-divergence", base]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another text, window"));
    let _ = std::fs::remove_dir_all(&dir);
}
