//! The rate at which one core reads the access pattern of decode attention, for
//! kernels/PERF.md: runs of `RUN` bytes (a KV block's rows of one head: 16 positions × 128
//! bytes = 2 KiB by default) at scattered places of a 1 GiB buffer on huge pages, 64 MiB a
//! pass after 512 MiB of other writes (so from DRAM), in units of `UNIT` runs (a sequence's
//! keys and values of one head at 200 positions: 26). Each way of reading is timed 5 times,
//! the best kept:
//! - `one after another`: each run read in order, no prefetch;
//! - `next unit, run by run`: as the attention kernel asks for the next unit's rows, one run
//!   per share of the current unit's work;
//! - `next unit, line by line`: the same share of every run's lines per share of work;
//! - `loads across K runs`: K runs read side by side, a line of each in turn (the order a
//!   position-ordered sum cannot take, for the bound).
//!
//! `cargo run --release -p kvx-kernels --example rowread [RUN] [UNIT]`

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    use std::time::Instant;

    let mut args = std::env::args().skip(1);
    let run: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2048).max(64) & !63;
    let unit: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(26).max(1);
    let big = Buffer::new(1 << 30);
    let mut other = vec![0u8; 512 << 20];
    let lines = run / 64;
    // Scattered run starts (a fixed pseudo-random sequence), one unit more for the prefetches.
    let n_runs = ((64 << 20) / run) / unit * unit;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let starts: Vec<usize> = (0..n_runs + unit)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as usize % (big.len / run)) * run
        })
        .collect();
    let bytes = big.bytes();
    let line =
        |at: usize| -> u64 { u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8])) };
    let pf = |at: usize| {
        // SAFETY: a prefetch never faults and has no architectural effect; `at` is inside the
        // buffer.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().wrapping_add(at).cast()) }
    };
    println!("runs of {run} bytes, units of {unit} runs, 64 MiB a pass from DRAM");
    let ways: [(&str, usize); 7] = [
        ("one after another", 0),
        ("next unit, run by run", 1),
        ("next unit, line by line", 2),
        ("loads across 2 runs", 102),
        ("loads across 4 runs", 104),
        ("loads across 8 runs", 108),
        ("loads across 16 runs", 116),
    ];
    for (name, way) in ways {
        let mut best = f64::INFINITY;
        let mut sink = 0u64;
        for rep in 0..5u8 {
            other.fill(rep);
            let t = Instant::now();
            if way >= 100 {
                let k = way - 100;
                for group in starts[..n_runs].chunks(k) {
                    for l in 0..lines {
                        for &s in group {
                            sink = sink.wrapping_add(line(s + 64 * l));
                        }
                    }
                }
            } else {
                for (u, runs) in starts[..n_runs].chunks(unit).enumerate() {
                    let next = &starts[(u + 1) * unit..(u + 2) * unit];
                    for (c, &s) in runs.iter().enumerate() {
                        match way {
                            1 => (0..lines).for_each(|l| pf(next[c] + 64 * l)),
                            2 => {
                                for l in c * lines / unit..(c + 1) * lines / unit {
                                    next.iter().for_each(|&n| pf(n + 64 * l));
                                }
                            }
                            _ => {}
                        }
                        for l in 0..lines {
                            sink = sink.wrapping_add(line(s + 64 * l));
                        }
                    }
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gbs = (n_runs * run) as f64 / best / 1e9;
        println!("{name:26} {gbs:5.1} GB/s  [{}]", std::hint::black_box(sink) % 10);
    }
}

/// An anonymous mapping on transparent huge pages (as the KV cache is), written once.
#[cfg(target_arch = "x86_64")]
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

#[cfg(target_arch = "x86_64")]
impl Buffer {
    fn new(len: usize) -> Buffer {
        // SAFETY: an anonymous private mapping of `len` bytes; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(ptr != libc::MAP_FAILED, "mmap of {len} bytes failed");
        // SAFETY: advice on the mapping just made; a refusal changes nothing.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        let buf = Buffer { ptr: ptr.cast(), len };
        // SAFETY: the mapping is `len` bytes, readable and writable, and owned by `buf`.
        unsafe { std::ptr::write_bytes(buf.ptr, 1, len) };
        buf
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` initialized bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new`, no longer borrowed.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86_64 only");
}
