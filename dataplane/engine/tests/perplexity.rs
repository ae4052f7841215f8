//! Perplexity and KL divergence on the real model (`eval::perplexity`): windows scored as
//! llama-perplexity scores them, the same numbers the scheduler's prompt scores give, a saved
//! base that compares equal to itself and refuses another text, and the reference arithmetic
//! (f32/f64, `ReferenceBackend`) close to the fast kernels, batch-invariant, and measured
//! against them with the KL divergence, and with roundings added to it (`RefRounding`).
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

mod common;

use common::{engine, model, sched};
use kvx_engine::eval::{self, Rows};
use kvx_engine::{Backend, ModelBackend, ReferenceBackend};
use kvx_kernels::cpu;
use kvx_kernels::model::{Arith, AttnMode, LlamaModel, Logits, RefRounding, SeqChunk};
use kvx_kernels::par::ThreadPool;
use std::sync::Arc;

const TEXT: &str = "The sky is blue and the grass is green. Rivers run to the sea, and \
    the sea gives the rain back to the hills; in spring the fields are ploughed and sown, \
    in autumn the harvest is brought in before the first frost. ";

fn kernels(m: &Arc<LlamaModel>, blocks: usize) -> ModelBackend {
    let pool = ThreadPool::new(2).expect("pool");
    ModelBackend::new(m.clone(), cpu::kernels(), pool, blocks, 16, 512, 1024).expect("backend")
}

fn reference(m: &Arc<LlamaModel>, blocks: usize) -> ReferenceBackend {
    let pool = ThreadPool::new(2).expect("pool");
    ReferenceBackend::new(m.clone(), pool, blocks, 16, 512, 1024).expect("backend")
}

#[test]
fn perplexity_is_the_sum_of_the_engines_prompt_scores_and_refuses_what_it_cannot_score() {
    let m = model();
    let tok = common::tokenizer();
    let mut b = kernels(&m, 64);
    let text = TEXT.repeat(3);
    // A batch other than llama.cpp's 512 that splits a window.
    let err = eval::perplexity_of_text(&mut b, 16, &tok, &text, (1024, 256), Rows::default())
        .unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
    // Fewer tokens than one window.
    let err = eval::perplexity_of_text(&mut b, 16, &tok, "Hello.", (64, 512), Rows::default())
        .unwrap_err();
    assert!(err.to_string().contains("fewer than one window"), "{err}");
    // A window the cache cannot hold.
    let mut small = kernels(&m, 2);
    let err = eval::perplexity_of_text(&mut small, 16, &tok, &text, (64, 512), Rows::default())
        .unwrap_err();
    assert!(err.to_string().contains("KV blocks"), "{err}");

    // Windows of 64: the tokens after position 32 of each are scored, several windows per
    // step (512 / 64), as llama.cpp batches them.
    let (p, n) =
        eval::perplexity_of_text(&mut b, 16, &tok, &text, (64, 512), Rows::default()).expect("ppl");
    assert_eq!(p.chunks, n / 64);
    assert!(p.chunks >= 2, "{p:?}");
    assert_eq!(p.scored, p.chunks * 31);
    assert!(p.ppl > 1.0 && p.ppl.is_finite() && p.kl.is_none(), "{p:?}");

    // The same windows as scored prompts through the scheduler: the same log-likelihoods.
    let bos = tok.bos_id().filter(|_| tok.add_bos());
    let mut tokens: Vec<u32> = bos.into_iter().collect();
    tokens.extend(tok.encode(&text, false).expect("encode"));
    let windows: Vec<(Vec<u32>, usize)> = tokens
        .chunks_exact(64)
        .map(|w| {
            let mut w = w.to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            (w, 33)
        })
        .collect();
    let mut e = engine(&m, 64, sched(512, true));
    let nll: f64 =
        eval::loglikelihoods(&mut e, &windows, 2).expect("loglik").iter().map(|l| -l.logprob).sum();
    assert!((nll - p.nll).abs() < 1e-4 * p.nll, "scheduler {nll} vs windows {}", p.nll);
}

#[test]
fn a_saved_base_compares_equal_to_itself_and_refuses_another_text() {
    let m = model();
    let tok = common::tokenizer();
    let mut b = kernels(&m, 64);
    let text = TEXT.repeat(3);
    let mut saved = Vec::new();
    let rows = Rows { save: Some(&mut saved), base: None, kld: None };
    let (p, _) = eval::perplexity_of_text(&mut b, 16, &tok, &text, (64, 512), rows).expect("save");
    assert_eq!(saved.len(), 32 + p.scored * m.cfg.n_vocab * 4);

    let rows = Rows { save: None, base: Some(&mut saved.as_slice()), kld: None };
    let (q, _) = eval::perplexity_of_text(&mut b, 16, &tok, &text, (64, 512), rows).expect("kld");
    let k = q.kl.expect("kl stats");
    assert_eq!(q.ppl, p.ppl);
    assert_eq!((k.kld_mean, k.kld_max, k.top1, k.dp_rms), (0.0, 0.0, 1.0, 0.0), "{k:?}");
    assert!((k.ppl_base - p.ppl).abs() < 1e-5 * p.ppl, "{k:?} vs {p:?}");

    // Another window, another text, a truncated file: clear errors.
    for (ctx, text, bytes) in [
        (32, text.as_str(), saved.len()),
        (64, &*TEXT.repeat(4), saved.len()),
        (64, text.as_str(), saved.len() / 2),
    ] {
        let rows = Rows { save: None, base: Some(&mut &saved[..bytes]), kld: None };
        let err = eval::perplexity_of_text(&mut b, 16, &tok, text, (ctx, 512), rows).unwrap_err();
        assert!(matches!(err, eval::EvalError::Logprobs(_)), "{err}");
    }
    let rows = Rows { save: None, base: Some(&mut &b"not a base"[..]), kld: None };
    let err = eval::perplexity_of_text(&mut b, 16, &tok, &text, (64, 512), rows).unwrap_err();
    assert!(err.to_string().contains("header") || err.to_string().contains("not a file"), "{err}");
}

/// All rows of one prompt computed by `b`, in steps of the given sizes.
fn rows(b: &mut dyn Backend, p: &[u32], steps: &[usize]) -> Vec<f32> {
    let v = b.n_vocab();
    let table: Vec<u32> = (0..p.len().div_ceil(16) as u32).collect();
    let mut out = Vec::new();
    let mut logits = vec![0.0; p.len() * v];
    let mut start = 0;
    for &n in steps {
        let chunk = SeqChunk {
            tokens: &p[start..start + n],
            start_pos: start,
            block_table: &table,
            logits: Logits::All,
            mode: if n >= 2 { AttnMode::Prefill } else { AttnMode::Decode },
        };
        b.forward(&[chunk], &mut logits).expect("forward");
        out.extend_from_slice(&logits[..n * v]);
        start += n;
    }
    assert_eq!(start, p.len());
    out
}

#[test]
fn the_reference_arithmetic_is_close_to_the_kernels_batch_invariant_and_measured_by_kld() {
    let m = model();
    let tok = common::tokenizer();
    let p: Vec<u32> = tok
        .encode("The capital of France is Paris, and the capital of Italy is", true)
        .expect("encode");
    let n = p.len();
    let v = m.cfg.n_vocab;
    let mut r = reference(&m, 8);
    let whole = rows(&mut r, &p, &[n]);
    // Batch invariance: the same rows, bit for bit, from other splits of the prompt.
    let split = rows(&mut r, &p, &[5, 1, n - 6]);
    assert!(whole.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Close to the kernels' (ggml's association with quantized activations and an f16
    // cache): the same most likely next token almost everywhere, logits within a few
    // tenths, and the continuation the model knows.
    let mut f = kernels(&m, 8);
    let exact = rows(&mut f, &p, &[n]);
    let argmax =
        |row: &[f32]| row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
    let mut agree = 0;
    let mut worst = 0f32;
    for i in 0..n {
        let (a, b) = (&whole[i * v..(i + 1) * v], &exact[i * v..(i + 1) * v]);
        assert!(a.iter().all(|x| x.is_finite()));
        agree += usize::from(argmax(a) == argmax(b));
        worst = a.iter().zip(b).fold(worst, |w, (x, y)| w.max((x - y).abs()));
    }
    assert!(agree + 1 >= n, "top-1 agreed on {agree} of {n} rows");
    assert!(worst < 1.5, "logits differ by up to {worst}");
    let rome = tok.encode(" Rome", false).expect("encode")[0] as usize;
    assert_eq!(argmax(&whole[(n - 1) * v..]), rome);

    // The kernels measured against the reference: a small, nonzero divergence.
    let text = TEXT.repeat(2);
    let mut base = Vec::new();
    let rows_ = Rows { save: Some(&mut base), base: None, kld: None };
    let (pr, _) = eval::perplexity_of_text(&mut r, 16, &tok, &text, (48, 512), rows_).expect("ref");
    let mut values = Vec::new();
    let rows_ = Rows { save: None, base: Some(&mut base.as_slice()), kld: Some(&mut values) };
    let (pe, _) = eval::perplexity_of_text(&mut f, 16, &tok, &text, (48, 512), rows_).expect("kld");
    let k = pe.kl.expect("kl");
    assert!(k.kld_mean > 0.0 && k.kld_mean < 0.02, "{k:?}");
    // Every scored token's divergence, in order: the statistics are theirs.
    let values: Vec<f64> =
        values.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8"))).collect();
    assert_eq!(values.len(), pe.scored);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    assert!((mean - k.kld_mean).abs() <= 1e-12 * k.kld_mean, "{mean} vs {k:?}");
    assert_eq!(values.iter().copied().fold(0.0, f64::max), k.kld_max);
    assert!(k.top1 > 0.9, "{k:?}");
    assert!((pe.ppl / pr.ppl - 1.0).abs() < 0.05, "{} vs {}", pe.ppl, pr.ppl);
    assert!((k.ppl_base / pr.ppl - 1.0).abs() < 1e-5, "{k:?}");
}

#[test]
fn reference_roundings_parse_as_written_and_round_only_what_they_name() {
    for spec in ["none", "kv=f16", "weights=bf16,acts=bf16,kv=f16", "acts=f16"] {
        let r: RefRounding = spec.parse().expect(spec);
        assert_eq!(r.to_string(), spec);
    }
    assert_eq!(" kv = f16 ".parse::<RefRounding>().expect("spaces").to_string(), "kv=f16");
    for bad in ["", "kv", "kv=f32", "keys=f16", "kv=f16,kv=bf16", "weights=bf16,", "none,kv=f16"] {
        let err = bad.parse::<RefRounding>().expect_err(bad);
        assert!(err.to_string().contains("reference rounding"), "{bad:?}: {err}");
    }

    let m = model();
    let tok = common::tokenizer();
    let p: Vec<u32> = tok
        .encode("The capital of France is Paris, and the capital of Italy is", true)
        .expect("encode");
    let (n, v) = (p.len(), m.cfg.n_vocab);
    let with = |spec: &str| reference(&m, 8).with_rounding(spec.parse().expect("spec"));
    let plain = rows(&mut reference(&m, 8), &p, &[n]);
    let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    // No rounding: the reference's bits.
    assert!(bits(&rows(&mut with("none"), &p, &[n]), &plain));
    let worst = |a: &[f32]| a.iter().zip(&plain).fold(0f32, |w, (x, y)| w.max((x - y).abs()));
    // Each rounding reaches the values it names and moves the logits, the f16 cache least
    // (11 significant bits, on the cached rows only), still near the reference; the three
    // together stay batch-invariant.
    let mut moved = Vec::new();
    for spec in ["kv=f16", "weights=bf16", "acts=bf16", "weights=bf16,acts=bf16,kv=f16"] {
        let mut b = with(spec);
        let whole = rows(&mut b, &p, &[n]);
        assert!(whole.iter().all(|x| x.is_finite()), "{spec}");
        if spec.contains(',') {
            assert!(bits(&rows(&mut b, &p, &[5, 1, n - 6]), &whole), "{spec}: batch invariance");
        }
        let w = worst(&whole);
        assert!(w > 0.0 && w < 1.0, "{spec}: logits moved by up to {w}");
        let argmax =
            |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, &x)| if x > r[b] { i } else { b });
        assert_eq!(argmax(&whole[(n - 1) * v..]), argmax(&plain[(n - 1) * v..]), "{spec}");
        moved.push(w);
    }
    assert!(moved[0] < moved[1] && moved[0] < moved[2] && moved[0] < moved[3], "{moved:?}");
}

#[test]
fn the_preferred_arithmetic_is_split_where_the_fast_products_pay_and_exact_elsewhere() {
    let m = model();
    let k = cpu::kernels();
    assert!(m.can_split_kv());
    let want = if k.fast_lanes_pay() { Arith::Split } else { Arith::Exact };
    assert_eq!(m.preferred_arith(k), want);
    // Without row-lane kernels `split` would be `exact`'s products and more.
    let scalar = cpu::Kernels::for_level(cpu::SimdLevel::Scalar).expect("scalar");
    assert!(!scalar.fast_lanes_pay());
    assert_eq!(m.preferred_arith(&scalar), Arith::Exact);
}

#[test]
fn amx_tiles_change_no_bit_of_the_logits() {
    // Where the CPU has AMX tiles and the OS grants them, the `split` products of 16 or more
    // tokens run on them (`cpu::tiles_granted`): every logit of a prompt, whole or in steps
    // of 16 tokens and more, must be the vector kernel's.
    let m = common::model_in(Arith::Split);
    let tok = common::tokenizer();
    let p: Vec<u32> = tok.encode(&TEXT.repeat(2), true).expect("encode");
    let n = p.len();
    assert!(n >= 64, "a prompt of {n} tokens");
    let plain: &'static cpu::Kernels = Box::leak(Box::new(cpu::kernels().without_tiles()));
    assert!(!plain.uses_tiles());
    eprintln!(
        "AMX tiles: {}",
        if cpu::kernels().uses_tiles() { "compared" } else { "not granted on this machine" }
    );
    let pool = ThreadPool::new(2).expect("pool");
    let mut vector = ModelBackend::new(m.clone(), plain, pool, 16, 16, 512, 1024).expect("backend");
    let mut tiles = kernels(&m, 16);
    // One step of the whole prompt, then steps of 16 and 20 tokens.
    for steps in [vec![n], vec![16, 20, n - 36]] {
        let (a, b) = (rows(&mut tiles, &p, &steps), rows(&mut vector, &p, &steps));
        assert_eq!(a.len(), b.len());
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "steps {steps:?}: logits differ with tiles");
    }
}

#[test]
fn the_split_arithmetic_is_batch_invariant_and_nearer_the_reference_than_exact() {
    let (exact_m, split_m) = (model(), common::model_in(Arith::Split));
    assert!(split_m.can_split_kv());
    // The first half of the layers split, rounded up; no layer of another arithmetic.
    let n_layers = split_m.layers.len();
    let split_layers: Vec<usize> = (0..n_layers).filter(|&l| split_m.splits_kv(l)).collect();
    assert_eq!(split_layers, (0..n_layers.div_ceil(2)).collect::<Vec<_>>());
    assert!((0..n_layers).all(|l| !exact_m.splits_kv(l)));
    let tok = common::tokenizer();
    let p: Vec<u32> = tok
        .encode("The capital of France is Paris, and the capital of Italy is", true)
        .expect("encode");
    let n = p.len();
    let mut s = kernels(&split_m, 8);
    let whole = rows(&mut s, &p, &[n]);
    let steps = rows(&mut s, &p, &[5, 1, n - 6]);
    assert!(whole.iter().zip(&steps).all(|(a, b)| a.to_bits() == b.to_bits()));
    // It computes something else than exact and than fast (`split` less its split): the
    // K/V products take a second part.
    let mut e = kernels(&exact_m, 8);
    assert_ne!(rows(&mut e, &p, &[n]), whole);
    let fast_m = common::model_in(Arith::Fast);
    assert!((0..n_layers).all(|l| !fast_m.splits_kv(l)));
    let mut f = kernels(&fast_m, 8);
    assert_ne!(rows(&mut f, &p, &[n]), whole);

    // Against the reference: a smaller divergence than exact's, by a margin (0.85× here at the
    // AVX-512 level; 0.88× on the 7,395 tokens of kernels/PERF.md's table, where splitting
    // every layer's K/V products gave 0.77× and no split at all, `fast`, 0.99×).
    let mut r = reference(&exact_m, 8);
    let text = TEXT.repeat(2);
    let mut base = Vec::new();
    let rows_ = Rows { save: Some(&mut base), base: None, kld: None };
    eval::perplexity_of_text(&mut r, 16, &tok, &text, (48, 512), rows_).expect("ref");
    let kld = |b: &mut dyn Backend| {
        let rows_ = Rows { save: None, base: Some(&mut base.as_slice()), kld: None };
        let (p, _) = eval::perplexity_of_text(b, 16, &tok, &text, (48, 512), rows_).expect("kld");
        p.kl.expect("kl").kld_mean
    };
    let (ke, ks, kf) = (kld(&mut e), kld(&mut s), kld(&mut f));
    eprintln!("KLD to the reference: exact {ke:.6}, split {ks:.6}, fast {kf:.6}");
    assert!(ks > 0.0 && ks < 0.9 * ke, "split {ks} vs exact {ke}");
    // And nearer than `fast`, which it is but for the split.
    assert!(ks < kf, "split {ks} vs fast {kf}");
}
