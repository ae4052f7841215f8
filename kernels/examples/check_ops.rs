//! Compares kvx's softmax and attention-value sums with tensors dumped from llama.cpp
//! (debugging aid for bit-exactness work; inputs are raw little-endian f32 files).

use half::f16;
use kvx_kernels::cpu::{Kernels, SimdLevel};

fn read(p: &str) -> Vec<f32> {
    let b = std::fs::read(p).expect("read");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn main() {
    let mut a = std::env::args().skip(1);
    let prefix = a.next().expect("prefix");
    let level = SimdLevel::from_name(&a.next().expect("level")).expect("level name");
    let k = Kernels::for_level(level).expect("supported");
    let n_tok = 4;
    let kq = read(&format!("{prefix}_kq.bin")); // [head 9][tok 4][256]
    let sm = read(&format!("{prefix}_sm.bin"));
    let kqv = read(&format!("{prefix}_kqv.bin")); // [head 9][tok 4][64]
    let v = read(&format!("{prefix}_v.bin")); // [tok 4][kvhead 3][64]
    let (mut sm_ok, mut kqv_ok, mut kqv_ok_dec) = (0, 0, 0);
    for h in 0..9 {
        for t in 0..n_tok {
            let row = &kq[(h * n_tok + t) * 256..][..256];
            let n = t + 1;
            let mut x: Vec<f32> = row[..n].to_vec();
            (k.softmax)(&mut x, 0.125);
            let want = &sm[(h * n_tok + t) * 256..][..n];
            sm_ok += usize::from(x.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()));
            // kqv from the oracle's probabilities
            let probs: Vec<f16> = want.iter().map(|&p| f16::from_f32(p)).collect();
            for (shape, ok) in [(k.attn.prefill, &mut kqv_ok), (k.attn.decode, &mut kqv_ok_dec)] {
                let step = shape.step();
                let mut classes = vec![0.0f32; step * 64];
                for (p, w) in probs.iter().enumerate() {
                    let vr: Vec<f16> = v[(p * 3 + h / 3) * 64..][..64].iter().map(|&x| f16::from_f32(x)).collect();
                    let c = p % step;
                    (k.axpy_f16)(w.to_f32(), &vr, &mut classes[c * 64..(c + 1) * 64]);
                }
                let mut all = true;
                for d in 0..64 {
                    let lanes: Vec<f32> = (0..step).map(|c| classes[c * 64 + d]).collect();
                    let got = shape.finish(&lanes, 0.0);
                    all &= got.to_bits() == kqv[(h * n_tok + t) * 64 + d].to_bits();
                }
                *ok += usize::from(all);
            }
        }
    }
    println!("softmax rows equal: {sm_ok}/36, kqv rows equal (prefill shape): {kqv_ok}/36, (decode shape): {kqv_ok_dec}/36");
}
