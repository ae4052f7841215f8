//! A worker's performance profile: what `kvx profile` measures on one worker shape and the
//! SLA planner and `kvx configure` read — time to first token and prefill throughput over
//! prompt lengths, inter-token latency and decode throughput over a grid of batch sizes and
//! context lengths — with the interpolation both use.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The worker a profile was measured on. A profile describes one shape; the planner sizes
/// pools of workers of that shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerShape {
    /// `model` or `mocker`.
    pub engine: String,
    /// The role measured: `agg`, `prefill` or `decode`.
    pub role: String,
    /// Engine shards per worker.
    pub shards: u32,
    /// Kernel threads per shard.
    pub threads_per_shard: u32,
    /// Kernel instruction set (`avx512`, `avx2`, `scalar`; `none` for the mocker).
    pub simd: String,
    /// The arithmetic the engines computed in (`exact`, `split`, ...; empty for the mocker
    /// and for profiles written before it was recorded).
    #[serde(default)]
    pub arith: String,
    /// The model's file name, size and arithmetic (`file:size:arith`; the mocker's timing
    /// model for mocks).
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks per shard.
    pub kv_blocks: u32,
    /// Tokens one engine step takes at most.
    pub max_batched_tokens: u32,
    /// Bytes of KV per token (keys and values, all layers): what a disaggregated transfer
    /// moves per prompt token. 0 when unknown (profiles written before it was recorded).
    #[serde(default)]
    pub kv_bytes_per_token: u64,
    /// The CPU it ran on (`/proc/cpuinfo`'s model name), for the record.
    pub cpu: String,
}

/// One prompt length: a prompt prefilled alone on an idle worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    /// Prompt tokens.
    pub isl: u32,
    /// Time to first token, milliseconds (median of the repetitions).
    pub ttft_ms: f64,
    /// Prompt tokens per second of one worker (`isl / ttft`).
    pub tok_s: f64,
}

/// One batch size at one context length: steps that each decode one token of every sequence.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    /// Sequences decoding together.
    pub batch: u32,
    /// Tokens in each sequence's context (prompt and output so far).
    pub context: u32,
    /// Inter-token latency, milliseconds (median step time).
    pub itl_ms: f64,
    /// Output tokens per second of one worker (`batch / itl`).
    pub tok_s: f64,
}

/// What `kvx profile` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Format version.
    pub version: u32,
    /// The worker measured.
    pub shape: WorkerShape,
    /// Repetitions per point (each point is their median).
    pub reps: u32,
    /// The sampling temperature of the decode points' requests (0: greedy; `kvx profile`
    /// measures at 1, the API's default, so a step carries the draw a served request costs).
    #[serde(default)]
    pub temperature: f32,
    /// Prompt lengths, ascending.
    pub prefill: Vec<PrefillPoint>,
    /// Batch sizes at context lengths, sorted by context then batch: at each context the
    /// batches up to the most that fit the worker's KV cache (or the sweep's largest).
    pub decode: Vec<DecodePoint>,
}

/// Why a profile cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// Not a profile this version reads.
    #[error("profile version {0} (this kvx reads version {PROFILE_VERSION})")]
    Version(u32),
    /// Points missing or out of order.
    #[error("profile: {0}")]
    Invalid(String),
    /// The file could not be read, or is not a profile.
    #[error("{0}")]
    File(String),
}

/// The longest prompt or context a profile may hold.
const MAX_TOKENS: u32 = 10_000_000;
/// The largest batch a profile may hold (capacity searches walk every batch up to it).
const MAX_BATCH: u32 = 65_536;

/// The profile format this kvx writes and reads.
pub const PROFILE_VERSION: u32 = 1;

/// Linear interpolation of `ys` over ascending `xs` at `x`: flat below the first point (no
/// time is known to be shorter than the shortest measured), extended by the last segment
/// past the end (one point: that value). Never below zero.
fn lerp(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    match xs.len() {
        0 => 0.0,
        1 => ys[0].max(0.0),
        _ if x <= xs[0] => ys[0].max(0.0),
        n => {
            let i = xs.partition_point(|&v| v <= x).clamp(1, n - 1);
            let (x0, x1, y0, y1) = (xs[i - 1], xs[i], ys[i - 1], ys[i]);
            let t = if x1 > x0 { (x - x0) / (x1 - x0) } else { 0.0 };
            (y0 + t * (y1 - y0)).max(0.0)
        }
    }
}

impl Profile {
    /// Reads the profile at `path` (JSON, as `kvx profile` writes it) and checks it.
    pub fn read(path: &Path) -> Result<Self, ProfileError> {
        let show = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ProfileError::File(format!("reading {show}: {e}")))?;
        let p: Profile = serde_json::from_str(&text)
            .map_err(|e| ProfileError::File(format!("{show} is not a profile: {e}")))?;
        p.validate()?;
        Ok(p)
    }

    /// Writes it to `path` as pretty JSON.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }

    /// Checks the version and the order of the points; the decode grid must be complete.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.version != PROFILE_VERSION {
            return Err(ProfileError::Version(self.version));
        }
        let bad = |m: &str| Err(ProfileError::Invalid(m.into()));
        if self.prefill.is_empty() || self.decode.is_empty() {
            return bad("no prefill or no decode points");
        }
        if self.prefill.windows(2).any(|w| w[0].isl >= w[1].isl) {
            return bad("prefill points are not in ascending prompt length");
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("the decode points' temperature is not a temperature");
        }
        let finite = |v: f64| v.is_finite() && v > 0.0;
        if self.prefill.iter().any(|p| !finite(p.ttft_ms) || !finite(p.tok_s))
            || self.decode.iter().any(|p| !finite(p.itl_ms) || !finite(p.tok_s))
        {
            return bad("a point has a time or rate that is not a positive number");
        }
        let sane = |v: u32, most: u32| (1..=most).contains(&v);
        if self.prefill.iter().any(|p| !sane(p.isl, MAX_TOKENS))
            || self.decode.iter().any(|p| !sane(p.batch, MAX_BATCH) || !sane(p.context, MAX_TOKENS))
        {
            return bad(
                "a prompt length or context is 0 or above 10,000,000, or a batch 0 or above 65,536",
            );
        }
        if self.decode.windows(2).any(|w| (w[0].context, w[0].batch) >= (w[1].context, w[1].batch))
        {
            return bad("decode points are not sorted by context, then batch size");
        }
        Ok(())
    }

    /// The decode points' context lengths, ascending.
    pub fn contexts(&self) -> Vec<u32> {
        let mut c: Vec<u32> = self.decode.iter().map(|p| p.context).collect();
        c.dedup();
        c
    }

    /// The decode points at one profiled context.
    fn row(&self, context: u32) -> &[DecodePoint] {
        let start = self.decode.partition_point(|p| p.context < context);
        let end = self.decode.partition_point(|p| p.context <= context);
        &self.decode[start..end]
    }

    /// KV tokens one worker holds.
    pub fn kv_tokens(&self) -> f64 {
        f64::from(self.shape.kv_blocks) * f64::from(self.shape.block_size)
    }

    /// Time to first token of a prompt of `isl` tokens on an idle worker, milliseconds.
    pub fn ttft_ms(&self, isl: f64) -> f64 {
        let xs: Vec<f64> = self.prefill.iter().map(|p| f64::from(p.isl)).collect();
        let ys: Vec<f64> = self.prefill.iter().map(|p| p.ttft_ms).collect();
        lerp(&xs, &ys, isl)
    }

    /// Prompt tokens per second one worker prefills at prompts of `isl` tokens.
    pub fn prefill_tok_s(&self, isl: f64) -> f64 {
        let t = self.ttft_ms(isl);
        if t > 0.0 { isl.max(1.0) / t * 1e3 } else { 0.0 }
    }

    /// Inter-token latency at `batch` sequences of `context` tokens, milliseconds: linear
    /// over batch at each profiled context, then over context; linear past the edges.
    pub fn itl_ms(&self, batch: f64, context: f64) -> f64 {
        let contexts = self.contexts();
        let cx: Vec<f64> = contexts.iter().map(|&c| f64::from(c)).collect();
        let at_ctx: Vec<f64> = contexts
            .iter()
            .map(|&c| {
                let row = self.row(c);
                let xs: Vec<f64> = row.iter().map(|p| f64::from(p.batch)).collect();
                let ys: Vec<f64> = row.iter().map(|p| p.itl_ms).collect();
                lerp(&xs, &ys, batch)
            })
            .collect();
        lerp(&cx, &at_ctx, context)
    }

    /// The most sequences of `context` tokens one worker runs: what its KV cache holds, and
    /// no more than the largest batch the profile measured (the ITL of batches between a
    /// context's largest measured one and this comes from the context's trend).
    pub fn max_batch(&self, context: f64) -> f64 {
        let by_kv = (self.kv_tokens() / context.max(1.0)).floor();
        let measured = self.decode.iter().map(|p| f64::from(p.batch)).fold(0.0, f64::max);
        by_kv.min(measured)
    }

    /// The most output tokens per second one worker gives at `context` tokens while its ITL
    /// stays within `itl_ms`, with the batch that gives it; `None` when even one sequence is
    /// slower than that (or none fits).
    pub fn decode_capacity(&self, context: f64, itl_ms: f64) -> Option<(f64, f64)> {
        let max = self.max_batch(context);
        let mut best: Option<(f64, f64)> = None;
        let mut b = 1.0;
        while b <= max {
            let itl = self.itl_ms(b, context);
            if itl > 0.0 && itl <= itl_ms {
                let tok_s = b / itl * 1e3;
                if best.is_none_or(|(t, _)| tok_s > t) {
                    best = Some((tok_s, b));
                }
            }
            b += 1.0;
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Profile {
        let shape = WorkerShape {
            engine: "mocker".into(),
            role: "agg".into(),
            shards: 1,
            threads_per_shard: 1,
            simd: "none".into(),
            arith: String::new(),
            model: "mocker".into(),
            block_size: 16,
            kv_blocks: 1024,
            max_batched_tokens: 2048,
            kv_bytes_per_token: 0,
            cpu: "test".into(),
        };
        let prefill = [(100, 20.0), (1000, 110.0), (2000, 260.0)]
            .map(|(isl, ttft_ms)| PrefillPoint {
                isl,
                ttft_ms,
                tok_s: f64::from(isl) / ttft_ms * 1e3,
            })
            .to_vec();
        let mut decode = Vec::new();
        for (context, base) in [(256, 10.0), (2048, 20.0)] {
            for batch in [1, 8, 32] {
                let itl_ms = base + f64::from(batch);
                decode.push(DecodePoint {
                    batch,
                    context,
                    itl_ms,
                    tok_s: f64::from(batch) / itl_ms * 1e3,
                });
            }
        }
        Profile { version: PROFILE_VERSION, shape, reps: 3, temperature: 0.0, prefill, decode }
    }

    #[test]
    fn a_profile_written_reads_back_and_a_bad_file_is_an_error() {
        let dir = std::env::temp_dir().join(format!("kvx-profile-rw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.json");
        sample().write(&path).unwrap();
        assert_eq!(Profile::read(&path).unwrap(), sample());
        std::fs::write(&path, "{}").unwrap();
        assert!(
            matches!(Profile::read(&path), Err(ProfileError::File(m)) if m.contains("not a profile"))
        );
        assert!(matches!(Profile::read(&dir.join("none.json")), Err(ProfileError::File(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prefill_is_interpolated_and_extended_linearly() {
        let p = sample();
        assert!((p.ttft_ms(100.0) - 20.0).abs() < 1e-9);
        assert!((p.ttft_ms(550.0) - 65.0).abs() < 1e-9);
        assert!((p.ttft_ms(3000.0) - 410.0).abs() < 1e-9, "past the end: the last slope");
        assert_eq!(p.ttft_ms(0.0), 20.0, "flat below the shortest prompt");
        assert!((p.prefill_tok_s(1000.0) - 1000.0 / 0.110).abs() < 1e-6);
    }

    #[test]
    fn decode_is_bilinear_and_capacity_meets_the_latency() {
        let p = sample();
        assert!((p.itl_ms(8.0, 256.0) - 18.0).abs() < 1e-9);
        // Halfway in context, between batch 8 and 32.
        assert!((p.itl_ms(20.0, 1152.0) - (15.0 + 20.0)).abs() < 1e-9);
        // Within 30 ms at 256 tokens: batch 20 (10 + 20 ms) is the best.
        let (tok_s, b) = p.decode_capacity(256.0, 30.0).unwrap();
        assert_eq!(b, 20.0);
        assert!((tok_s - 20.0 / 30.0 * 1e3).abs() < 1e-6);
        assert!(p.decode_capacity(2048.0, 20.5).is_none(), "one sequence takes 21 ms there");
        // The KV cache (1024 blocks of 16 tokens) holds 8 sequences of 2048 tokens.
        assert_eq!(p.max_batch(2048.0), 8.0);
        assert_eq!(p.decode_capacity(2048.0, 100.0).map(|c| c.1), Some(8.0));
        assert_eq!(p.max_batch(100.0), 32.0, "the most measured");
        // Between profiled contexts the KV cache decides: 1024 × 16 / 1000 = 16.
        assert_eq!(p.max_batch(1000.0), 16.0);
        assert!(p.itl_ms(1.0, 1.0) >= 11.0, "flat below the shortest context and batch");
    }

    #[test]
    fn broken_profiles_are_refused() {
        let p = sample();
        assert_eq!(p.validate(), Ok(()));
        let mut q = p.clone();
        q.version = 9;
        assert_eq!(q.validate(), Err(ProfileError::Version(9)));
        let mut q = p.clone();
        q.decode.swap(3, 4);
        assert!(matches!(q.validate(), Err(ProfileError::Invalid(_))));
        let mut q = p.clone();
        q.prefill.swap(0, 1);
        assert!(matches!(q.validate(), Err(ProfileError::Invalid(_))));
        let mut q = p.clone();
        q.decode[5].batch = u32::MAX;
        assert!(matches!(q.validate(), Err(ProfileError::Invalid(_))));
        let mut q = p;
        q.decode[2].itl_ms = f64::NAN;
        assert!(matches!(q.validate(), Err(ProfileError::Invalid(_))));
        let json = serde_json::to_string(&sample()).unwrap();
        assert_eq!(serde_json::from_str::<Profile>(&json).unwrap(), sample());
    }
}
