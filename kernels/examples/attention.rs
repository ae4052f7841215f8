//! The free attention's cost per (position, KV head) of a decode token: the default model's
//! shape (64-element heads, 3 KV heads of 3 query heads, 200 positions in blocks of 16),
//! over `LAYERS` layers' cache rows, one call a (layer, KV head) unit (default 1: 0.2 MB,
//! in L2; 30: 4.8 MB, one sequence's, in L3; 240: 38 MB, eight sequences', still within
//! the ~100 MB of L3 this VM gives a core in practice; 1000: 160 MB, from DRAM). Unlike a
//! decode step it names no next unit to prefetch, and a layer's blocks lie together (the
//! engine's cache keeps a block's layers together instead).
//!
//! `cargo run --release -p kvx-kernels --example attention [LAYERS...]`

use std::time::Instant;

use half::f16;
use kvx_kernels::cpu;
use kvx_kernels::ops::{self, AttnMode, AttnScratch, PagedHead};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let k = cpu::kernels();
    let (hd, bs, n_kv, group, n_pos) = (64usize, 16usize, 3usize, 3usize, 200usize);
    let mut layers: Vec<usize> =
        std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    if layers.is_empty() {
        layers = vec![1, 30, 240, 1000];
    }
    if !ops::attention_free_covers(k, hd) {
        println!("{}: no free attention kernel for {hd}-element heads", k.level);
        return Ok(());
    }
    println!(
        "{}: free attention, {group} query heads of {hd} a KV head, {n_pos} positions",
        k.level
    );
    for n_layers in layers.into_iter().map(|n| n.max(1)) {
        let nb = n_pos.div_ceil(bs);
        let stride = n_kv * bs * hd;
        let len = n_layers * nb * stride;
        let fill = |m: usize| -> Vec<f16> {
            (0..len).map(|i| f16::from_f32(((i * m) % 1000) as f32 / 1000.0 - 0.5)).collect()
        };
        let (keys, values) = (fill(7919), fill(104_729));
        // Each layer's blocks, scattered over its region of the cache.
        let tables: Vec<Vec<u32>> = (0..n_layers)
            .map(|l| (0..nb).map(|b| (l * nb + b * 7 % nb) as u32).collect())
            .collect();
        let q: Vec<f32> = (0..group * hd).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
        let mut out = vec![0f32; group * hd];
        let mut sc = AttnScratch::new(hd, n_pos);
        let reps = 2000 / n_layers + 3;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                for table in &tables {
                    for kv_head in 0..n_kv {
                        let head = |data| PagedHead {
                            data,
                            block_table: table,
                            block_size: bs,
                            block_stride: stride,
                            head_dim: hd,
                            kv_head,
                        };
                        let (kh, vh) = (head(&keys[..]), head(&values[..]));
                        ops::attention_group(
                            k,
                            true,
                            AttnMode::Decode,
                            &q,
                            group,
                            &kh,
                            &vh,
                            n_pos,
                            0.125,
                            None,
                            &mut sc,
                            &mut out,
                        )?;
                    }
                }
            }
            let units = reps * n_layers * n_kv * n_pos;
            best = best.min(t.elapsed().as_secs_f64() / units as f64);
        }
        println!(
            "{n_layers} layer(s), {:.1} MB of rows: {:.1} ns per (position, KV head)",
            (2 * len * 2) as f64 / 1e6,
            best * 1e9
        );
    }
    Ok(())
}
