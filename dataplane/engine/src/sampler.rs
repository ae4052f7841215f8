//! Token sampling: penalties, temperature, top-k / top-p / min-p filtering and a seeded,
//! reproducible draw. Greedy (temperature 0) picks the first maximum, as llama.cpp does.
//!
//! A [`Sampler`] owns its scratch (one entry per vocabulary token), sized once; sampling a
//! token allocates nothing.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = none).
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Divides positive logits (multiplies negative ones) of tokens seen in the prompt or
    /// output (1 = off).
    pub repetition_penalty: f32,
    /// Seed of the request's random stream; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks ranges; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |v: f32, name: &str| {
            if v.is_finite() { Ok(()) } else { Err(format!("{name} must be a finite number")) }
        };
        finite(self.temperature, "temperature")?;
        finite(self.top_p, "top_p")?;
        finite(self.min_p, "min_p")?;
        finite(self.presence_penalty, "presence_penalty")?;
        finite(self.frequency_penalty, "frequency_penalty")?;
        finite(self.repetition_penalty, "repetition_penalty")?;
        if self.temperature < 0.0 {
            return Err("temperature must be >= 0".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err("top_p must be in (0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err("min_p must be in [0, 1]".into());
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err("presence_penalty must be in [-2, 2]".into());
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err("frequency_penalty must be in [-2, 2]".into());
        }
        if self.repetition_penalty <= 0.0 {
            return Err("repetition_penalty must be > 0".into());
        }
        Ok(())
    }

    /// Whether any penalty is active.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// The per-request sampling state: its random stream and the token counts penalties need.
#[derive(Debug, Clone)]
pub struct SamplerState {
    rng: ChaCha8Rng,
}

impl SamplerState {
    /// A state for `params` (seeded from `params.seed`, or from `fallback_seed`).
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        SamplerState { rng: ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(fallback_seed)) }
    }
}

/// A sampled token with its log-probability (under the unfiltered distribution at
/// temperature 1, as its field says).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// Token id.
    pub token: u32,
    /// Log-probability of `token` under the unfiltered distribution at temperature 1
    /// (what OpenAI's `logprobs` report).
    pub logprob: f32,
}

/// Sampling scratch for one vocabulary size (one per engine, reused for every token).
#[derive(Debug)]
pub struct Sampler {
    idx: Vec<u32>,
    probs: Vec<f32>,
    counts: Vec<u32>,
    touched: Vec<u32>,
    /// A copy of the logits for [`log_sum_exp`].
    lse_buf: Vec<f32>,
    /// Per token, its band of tempered distance to the best ([`BANDS`]: probability 0).
    band: Vec<u16>,
    /// Per band, the probability mass of its tokens (entry [`BANDS`] collects the tokens
    /// of probability 0; the rest are spare).
    band_mass: Vec<f64>,
}

impl Sampler {
    /// Scratch for a vocabulary of `n_vocab` tokens.
    pub fn new(n_vocab: usize) -> Self {
        Sampler {
            idx: Vec::with_capacity(n_vocab),
            probs: Vec::with_capacity(n_vocab),
            counts: vec![0; n_vocab],
            touched: Vec::with_capacity(n_vocab),
            lse_buf: Vec::with_capacity(n_vocab),
            band: Vec::with_capacity(n_vocab),
            band_mass: vec![0.0; MASS_SLOTS],
        }
    }

    /// Applies penalties to `logits` in place: `prompt` and `output` are the tokens so far.
    pub fn apply_penalties(
        &mut self,
        params: &SamplingParams,
        logits: &mut [f32],
        prompt: &[u32],
        output: &[u32],
    ) {
        if !params.has_penalties() {
            return;
        }
        self.touched.clear();
        for &t in output {
            if let Some(c) = self.counts.get_mut(t as usize) {
                if *c == 0 {
                    self.touched.push(t);
                }
                *c += 1;
            }
        }
        if params.repetition_penalty != 1.0 {
            let rp = params.repetition_penalty;
            let mut penalize = |t: u32| {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / rp } else { *l * rp };
                }
            };
            for &t in &self.touched {
                penalize(t);
            }
            for &t in prompt {
                // Tokens seen in both prompt and output are penalized once.
                if self.counts.get(t as usize).is_some_and(|&c| c == 0) {
                    penalize(t);
                    if let Some(c) = self.counts.get_mut(t as usize) {
                        *c = u32::MAX; // mark "prompt only", reset below
                        self.touched.push(t);
                    }
                }
            }
        }
        for &t in &self.touched {
            let c = self.counts[t as usize];
            if c != u32::MAX {
                logits[t as usize] -= params.presence_penalty + params.frequency_penalty * c as f32;
            }
        }
        for &t in &self.touched {
            self.counts[t as usize] = 0;
        }
    }

    /// Draws the next token from `logits` (already penalized). Its log-probability (under the
    /// untempered distribution) is computed only when `want_logprob` (0 otherwise): that costs
    /// an `exp` per vocabulary entry.
    pub fn sample(
        &mut self,
        params: &SamplingParams,
        state: &mut SamplerState,
        logits: &[f32],
        want_logprob: bool,
    ) -> Sampled {
        let (best, best_logit) = argmax(logits);
        let lse = want_logprob.then(|| log_sum_exp(&mut self.lse_buf, logits, best));
        let logprob_of = |t: u32| lse.map_or(0.0, |lse| logits[t as usize] - lse);
        if params.temperature == 0.0 {
            return Sampled { token: best, logprob: logprob_of(best) };
        }
        let inv_t = 1.0 / params.temperature;
        let max = best_logit * inv_t;
        if !max.is_finite() {
            // Nothing allowed (every logit -inf), or a temperature so small that the scaled
            // logits overflow: the draw's limit is the greedy pick (with top-k too).
            return Sampled { token: best, logprob: logprob_of(best) };
        }
        let k = if params.top_k > 0 { params.top_k.min(logits.len()) } else { logits.len() };
        if k == logits.len() {
            // The whole vocabulary's probabilities, from the kernels' softmax (vectorized
            // `exp`): a draw over a 50k vocabulary costs tens of microseconds, not hundreds.
            // Tokens more than [`NEGLIGIBLE`] tempered nats below the best get probability
            // 0 first: the draw cannot resolve them, and their f32 `exp`s would be
            // subnormal, which x86 cores compute in microcode (a mocker's flat tail or a cold
            // temperature made a draw cost 0.36 ms instead of 0.04).
            // Compared as the softmax computes it: the tempered logit against the tempered
            // maximum.
            let floor = max - NEGLIGIBLE;
            self.probs.clear();
            self.probs.extend(
                logits.iter().map(|&l| if l * inv_t < floor { f32::NEG_INFINITY } else { l }),
            );
            (kvx_kernels::cpu::kernels().softmax)(&mut self.probs, inv_t);
            let chosen = if params.top_p >= 1.0 {
                self.draw_in_id_order(params, state, best)
            } else {
                self.draw_from_nucleus(params, state, logits, best)
            };
            return Sampled { token: chosen, logprob: logprob_of(chosen) };
        }
        // The k best, ranked by logit (ties by id).
        if k <= ONE_PASS_TOP {
            self.rank_top(logits, k);
        } else {
            self.idx.clear();
            self.idx.extend(0..logits.len() as u32);
            self.idx.select_nth_unstable_by(k - 1, |&a, &b| rank(logits, a, b));
            self.idx.truncate(k);
            self.idx.sort_unstable_by(|&a, &b| rank(logits, a, b));
        }
        self.probs.clear();
        let mut sum = 0.0f64;
        for &i in &self.idx {
            let p = ((logits[i as usize] * inv_t - max) as f64).exp();
            sum += p;
            self.probs.push(p as f32);
        }
        // min-p relative to the top candidate (probability 1 after normalization by max).
        let mut keep = self.probs.len();
        if params.min_p > 0.0 {
            keep = self.probs.iter().take_while(|&&p| p >= params.min_p).count().max(1);
        }
        if params.top_p < 1.0 {
            let mut acc = 0.0f64;
            let mut n = 0;
            for &p in &self.probs[..keep] {
                acc += f64::from(p) / sum;
                n += 1;
                if acc >= f64::from(params.top_p) {
                    break;
                }
            }
            keep = n.max(1);
        }
        let total: f64 = self.probs[..keep].iter().map(|&p| f64::from(p)).sum();
        let mut r = state.rng.random::<f64>() * total;
        let mut chosen = self.idx[keep - 1];
        for (&i, &p) in self.idx[..keep].iter().zip(&self.probs[..keep]) {
            r -= f64::from(p);
            if r <= 0.0 {
                chosen = i;
                break;
            }
        }
        Sampled { token: chosen, logprob: logprob_of(chosen) }
    }

    /// Without top-p no ranking is needed: min-p is a threshold on each probability of
    /// `self.probs`, and the draw walks the vocabulary in id order, skipping whole chunks by
    /// their sums.
    fn draw_in_id_order(
        &mut self,
        params: &SamplingParams,
        state: &mut SamplerState,
        best: u32,
    ) -> u32 {
        if params.min_p > 0.0 {
            let floor = params.min_p * self.probs[best as usize];
            for p in self.probs.iter_mut() {
                *p = if *p < floor { 0.0 } else { *p };
            }
        }
        let total: f64 = self.probs.chunks(WALK).map(|c| chunk_sum(c, f32::NEG_INFINITY)).sum();
        let r = state.rng.random::<f64>() * total;
        walk(&self.probs, r).unwrap_or(best)
    }

    /// Top-p over the whole vocabulary (`self.probs`): the nucleus is the shortest prefix of
    /// the tokens ranked by logit (ties by id) whose probability reaches `top_p`, cut further
    /// by min-p (also a prefix). Where the tokens of probability ≥ 1e-3 (at most a thousand)
    /// hold `top_p`, only they are ranked; otherwise (a flat distribution, whose nucleus can
    /// hold tens of thousands of tokens) see [`Sampler::draw_from_bands`].
    fn draw_from_nucleus(
        &mut self,
        params: &SamplingParams,
        state: &mut SamplerState,
        logits: &[f32],
        best: u32,
    ) -> u32 {
        if params.min_p > 0.0 {
            let floor = params.min_p * self.probs[best as usize];
            for p in self.probs.iter_mut() {
                *p = if *p < floor { 0.0 } else { *p };
            }
        }
        let top_p = f64::from(params.top_p);
        let coarse = 1e-3f32;
        if self.probs.chunks(WALK).map(|c| chunk_sum(c, coarse)).sum::<f64>() < top_p {
            return self.draw_from_bands(state, logits, best, 1.0 / params.temperature, top_p);
        }
        let probs = &self.probs;
        self.idx.clear();
        self.idx.extend((0..logits.len() as u32).filter(|&i| probs[i as usize] >= coarse));
        let total = self.rank_and_cut(logits, 0.0, top_p);
        let r = state.rng.random::<f64>() * total;
        self.walk_ranked(r).unwrap_or(best)
    }

    /// Ranks `self.idx` by [`rank`] and keeps its shortest prefix whose probability, added to
    /// `before`, reaches `top_p` (all of it if none does); returns the kept probability.
    fn rank_and_cut(&mut self, logits: &[f32], before: f64, top_p: f64) -> f64 {
        self.idx.sort_unstable_by(|&a, &b| rank(logits, a, b));
        let mut kept = 0.0f64;
        let mut keep = self.idx.len();
        for (n, &i) in self.idx.iter().enumerate() {
            kept += f64::from(self.probs[i as usize]);
            if before + kept >= top_p {
                keep = n + 1;
                break;
            }
        }
        self.idx.truncate(keep);
        kept
    }

    /// The token of `self.idx` (ranked) where the running sum of its probabilities reaches
    /// `r`, or its last one when rounding leaves `r` past the end; `None` if it is empty.
    fn walk_ranked(&self, mut r: f64) -> Option<u32> {
        for &i in &self.idx {
            r -= f64::from(self.probs[i as usize]);
            if r <= 0.0 {
                return Some(i);
            }
        }
        self.idx.last().copied()
    }

    /// The nucleus of [`Sampler::draw_from_bands`]: `self.band` and `self.band_mass` filled,
    /// bands `..cut` kept whole, and `self.idx` the kept tokens of band `cut`, ranked.
    fn band_cut(&mut self, logits: &[f32], best: u32, inv_t: f32, top_p: f64) -> BandCut {
        let lmax = logits[best as usize];
        // Finite however cold the temperature (`validate` admits any positive one).
        let scale = (inv_t * (BANDS as f32 / NEGLIGIBLE)).min(f32::MAX);
        self.band.clear();
        let last = (BANDS - 1) as f32;
        self.band.extend(logits.iter().zip(&self.probs).map(|(&l, &p)| {
            // Monotone in `l`: a rounded difference, a positive factor, a clamp, and a
            // rounding to the nearest integer (adding 2^23 leaves it in the low bits).
            let d = ((lmax - l) * scale).min(last);
            let band = ((d + 8_388_608.0).to_bits() & 0x1fff) as u16;
            if p > 0.0 { band } else { BANDS as u16 }
        }));
        self.band_mass[..=BANDS].fill(0.0);
        if let Ok(mass) = <&mut [f64; MASS_SLOTS]>::try_from(&mut self.band_mass[..]) {
            // A band is at most `BANDS` < `MASS_SLOTS`: the mask only spares the bounds check.
            for (&b, &p) in self.band.iter().zip(&self.probs) {
                mass[usize::from(b) & (MASS_SLOTS - 1)] += f64::from(p);
            }
        }
        // Bands `..cut` are kept whole, the first `part` ranked tokens of band `cut` too.
        let mut cum = 0.0f64;
        let mut cut = BANDS;
        for (b, &m) in self.band_mass[..BANDS].iter().enumerate() {
            if cum + m >= top_p {
                cut = b;
                break;
            }
            cum += m;
        }
        self.idx.clear();
        let mut part_mass = 0.0f64;
        if cut < BANDS {
            let band = &self.band;
            self.idx.extend((0..logits.len() as u32).filter(|&i| band[i as usize] == cut as u16));
            part_mass = self.rank_and_cut(logits, cum, top_p);
        }
        BandCut { cut, whole: cum, part: part_mass }
    }

    /// The nucleus of a flat distribution without ranking it: each token with a probability
    /// goes to one of [`BANDS`] bands of its tempered distance to the best logit (a band
    /// never holds a higher logit than an earlier band), and the bands' masses, summed from
    /// the best, find the band where `top_p` is reached. Only that band's tokens are ranked
    /// for the exact cut (usually a few dozen to a few hundred; all of them where every
    /// logit falls in one band, no slower than ranking them all). The draw picks a band by
    /// mass, then a token in id order within it: the same distribution as a walk in rank
    /// order.
    fn draw_from_bands(
        &mut self,
        state: &mut SamplerState,
        logits: &[f32],
        best: u32,
        inv_t: f32,
        top_p: f64,
    ) -> u32 {
        let BandCut { cut, whole: cum, part: part_mass } =
            self.band_cut(logits, best, inv_t, top_p);
        let mut r = state.rng.random::<f64>() * (cum + part_mass);
        if r >= cum {
            // In the cut band's ranked part.
            return self.walk_ranked(r - cum).unwrap_or(best);
        }
        let Some(b) = self.band_mass[..cut].iter().position(|&m| {
            r -= m;
            r < 0.0
        }) else {
            // Rounding left `r` past the whole bands: the ranked part's first token, or the
            // best.
            return self.idx.first().copied().unwrap_or(best);
        };
        r += self.band_mass[b];
        let mut last = best;
        for (i, (&band, &p)) in self.band.iter().zip(&self.probs).enumerate() {
            if band == b as u16 {
                last = i as u32;
                r -= f64::from(p);
                if r < 0.0 {
                    return last;
                }
            }
        }
        last
    }

    /// The `n` most likely tokens with their log-probabilities (for `top_logprobs`),
    /// written to `out` (cleared first).
    pub fn top_logprobs(&mut self, logits: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
        out.clear();
        if n == 0 || logits.is_empty() {
            return;
        }
        let (best, _) = argmax(logits);
        let lse = log_sum_exp(&mut self.lse_buf, logits, best);
        self.top_under(logits, lse, n, out);
    }

    /// The log-probability of `token` under `logits` (a prompt token's score), with the `n`
    /// most likely tokens in `out` as [`Sampler::top_logprobs`] gives them: one normalizer
    /// for both, so the token has the same value in both when it is among them.
    pub fn score(
        &mut self,
        logits: &[f32],
        token: u32,
        n: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> f32 {
        out.clear();
        let Some(&l) = logits.get(token as usize) else { return f32::NEG_INFINITY };
        let (best, _) = argmax(logits);
        let lse = log_sum_exp(&mut self.lse_buf, logits, best);
        if n > 0 {
            self.top_under(logits, lse, n, out);
        }
        l - lse
    }

    /// The `n` most likely tokens with their log-probabilities under `lse`.
    fn top_under(&mut self, logits: &[f32], lse: f32, n: usize, out: &mut Vec<(u32, f32)>) {
        self.rank_top(logits, n);
        out.extend(self.idx.iter().map(|&i| (i, logits[i as usize] - lse)));
    }

    /// `self.idx` = the `n` best tokens ranked by logit (descending in `total_cmp`'s order,
    /// ties by id), in one pass that keeps the best `n` so far in order: a plain `<` against
    /// the last kept logit skips most tokens. For small `n` ([`ONE_PASS_TOP`] and below).
    fn rank_top(&mut self, logits: &[f32], n: usize) {
        let n = n.min(logits.len());
        self.idx.clear();
        if n == 0 {
            return;
        }
        let before = |a: u32, b: u32| rank(logits, a, b).is_lt();
        // Whatever the plain `<` passes, NaN and signed zeros included, `before` decides.
        let mut floor = f32::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            let i = i as u32;
            if l < floor {
                continue;
            }
            if self.idx.len() == n {
                if !before(i, self.idx[n - 1]) {
                    continue;
                }
                self.idx.pop();
            }
            let at = self.idx.partition_point(|&k| before(k, i));
            self.idx.insert(at, i);
            if self.idx.len() == n {
                floor = logits[self.idx[n - 1] as usize];
            }
        }
    }
}

/// How far below the best token, in tempered nats, a token still gets a probability in a
/// draw over the whole vocabulary: e^-70 ≈ 4e-31 of the best, far below the 2^-53 a draw's
/// f64 random number resolves, and even after normalization over a vocabulary of 10^7 a
/// normal f32 (no subnormal arithmetic).
const NEGLIGIBLE: f32 = 70.0;

/// Top-k up to this many is kept in one pass over the vocabulary ([`Sampler::rank_top`]; an
/// insertion costs up to this many moves, so a row whose logits rise with the id costs ~V·k);
/// a larger k is selected. The top log-probabilities (at most 20) always take the one pass.
const ONE_PASS_TOP: usize = 64;

/// Probabilities a draw skips at a time by their sum.
const WALK: usize = 64;

/// A flat distribution's nucleus: bands `..cut` whole (`whole`: their mass), and the ranked
/// tokens of band `cut` that `Sampler::band_cut` left in its `idx` (`part`: their mass).
struct BandCut {
    cut: usize,
    whole: f64,
    part: f64,
}

/// Bands of tempered distance to the best logit that a flat distribution's top-p cut sorts
/// its tokens into: [`NEGLIGIBLE`] nats in 4,096 bands of 0.017 nats.
const BANDS: usize = 4096;

/// Entries of the bands' mass array: a power of two above [`BANDS`].
const MASS_SLOTS: usize = 2 * BANDS;

/// The order tokens are ranked in: a higher logit first (in `total_cmp`'s order), ties by
/// the lower id.
fn rank(logits: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

/// The sum of a chunk's probabilities of at least `tau` (`f32::NEG_INFINITY`: all but NaN):
/// 16 lanes of f32 (the compiler vectorizes them), added up in f64.
fn chunk_sum(c: &[f32], tau: f32) -> f64 {
    let mut lanes = [0.0f32; 16];
    let parts = c.chunks_exact(16);
    let tail: f64 = parts.remainder().iter().filter(|&&p| p >= tau).map(|&p| f64::from(p)).sum();
    for part in parts {
        for (a, &p) in lanes.iter_mut().zip(part) {
            *a += if p >= tau { p } else { 0.0 };
        }
    }
    lanes.iter().map(|&a| f64::from(a)).sum::<f64>() + tail
}

/// The token where the running sum of `probs` (in id order) first reaches `r`: whole chunks
/// of [`WALK`] are passed by their [`chunk_sum`], the one holding `r` is walked one by one. A
/// token of probability 0 is never chosen; `None` when rounding leaves `r` past the end.
fn walk(probs: &[f32], mut r: f64) -> Option<u32> {
    for (c, chunk) in probs.chunks(WALK).enumerate() {
        let s = chunk_sum(chunk, f32::NEG_INFINITY);
        if r > s {
            r -= s;
            continue;
        }
        for (i, &p) in chunk.iter().enumerate() {
            r -= f64::from(p);
            if p > 0.0 && r <= 0.0 {
                return Some((c * WALK + i) as u32);
            }
        }
    }
    None
}

/// The first maximum and its value.
pub fn argmax(logits: &[f32]) -> (u32, f32) {
    // Two passes the compiler vectorizes (a greedy decode step runs this once per sequence
    // over the whole vocabulary): the maximum, 16 lanes at a time, then its first index.
    // NaNs never win (`l > m` is false for them), as in a plain scan.
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = logits.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    if max == f32::NEG_INFINITY {
        // Nothing above -inf: the first id, as a scan that never moves would give.
        return (0, max);
    }
    let mut base = 0;
    for c in logits.chunks(L) {
        if c.iter().fold(false, |hit, &l| hit | (l == max)) {
            let i = c.iter().position(|&l| l == max).unwrap_or(0);
            return ((base + i) as u32, c[i]);
        }
        base += c.len();
    }
    (0, max)
}

/// `ln Σ exp(logits)`, from the kernels' softmax (vectorized `exp`, an f64 sum) over a copy
/// in `buf`: the best token's probability is `exp(0) / Σ = 1 / Σ`, so the sum is its inverse.
/// NaN where the best logit is not finite (as `best − best` is NaN there).
fn log_sum_exp(buf: &mut Vec<f32>, logits: &[f32], best: u32) -> f32 {
    let Some(&max) = logits.get(best as usize).filter(|m| m.is_finite()) else {
        return f32::NAN;
    };
    buf.clear();
    buf.extend_from_slice(logits);
    (kvx_kernels::cpu::kernels().softmax)(buf, 1.0);
    max - buf[best as usize].ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain scan [`argmax`] must agree with: the first id above everything before it.
    fn argmax_scan(logits: &[f32]) -> (u32, f32) {
        let (mut best, mut val) = (0usize, f32::NEG_INFINITY);
        for (i, &l) in logits.iter().enumerate() {
            if l > val {
                (best, val) = (i, l);
            }
        }
        (best as u32, val)
    }

    #[test]
    fn argmax_matches_a_plain_scan() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, -0.0, 0.0];
        for len in [0, 1, 15, 16, 17, 100, 49152] {
            for round in 0..20 {
                let v: Vec<f32> = (0..len)
                    .map(|_| match rng.random_range(0..10) {
                        // Few distinct values make ties; specials test the edges.
                        0 if round % 2 == 0 => specials[rng.random_range(0..specials.len())],
                        1..=3 => rng.random_range(-3..3) as f32,
                        _ => rng.random_range(-30.0..30.0),
                    })
                    .collect();
                let (a, b) = (argmax(&v), argmax_scan(&v));
                assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()), "len {len}: {v:?}");
            }
        }
        let nan = [f32::NAN; 40];
        assert_eq!(argmax(&nan).0, 0);
        let mut late = vec![f32::NEG_INFINITY; 40];
        late[37] = -1e30;
        assert_eq!(argmax(&late), (37, -1e30));
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(4);
        let p = SamplingParams::greedy();
        let mut st = SamplerState::new(&p, 0);
        assert_eq!(s.sample(&p, &mut st, &[1.0, 3.0, 3.0, 2.0], false).token, 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0, 0.5];
        let p = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        let mut s = Sampler::new(4);
        let draw = |s: &mut Sampler| {
            let mut st = SamplerState::new(&p, 0);
            (0..2000).map(|_| s.sample(&p, &mut st, &logits, false).token).collect::<Vec<_>>()
        };
        let a = draw(&mut s);
        assert_eq!(a, draw(&mut s));
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for t in 0..4u32 {
            let freq = a.iter().filter(|&&x| x == t).count() as f64 / a.len() as f64;
            let want = f64::from(logits[t as usize]).exp() / z;
            assert!((freq - want).abs() < 0.04, "token {t}: {freq} vs {want}");
        }
    }

    /// The plain walk [`walk`] must agree with: the first token (of non-zero probability)
    /// where the running sum reaches `r`.
    fn walk_scan(probs: &[f32], mut r: f64) -> Option<u32> {
        for (i, &p) in probs.iter().enumerate() {
            r -= f64::from(p);
            if p > 0.0 && r <= 0.0 {
                return Some(i as u32);
            }
        }
        None
    }

    #[test]
    fn the_chunked_walk_matches_a_plain_walk() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for n in [1usize, 15, 64, 65, 1000, 49_152] {
            let probs: Vec<f32> =
                (0..n).map(|i| if i % 7 == 3 { 0.0 } else { rng.random::<f32>() * 1e-3 }).collect();
            let total: f64 = probs.chunks(WALK).map(|c| chunk_sum(c, f32::NEG_INFINITY)).sum();
            let exact: f64 = probs.iter().map(|&p| f64::from(p)).sum();
            assert!((total - exact).abs() <= 1e-6 * exact, "n={n}: {total} vs {exact}");
            for k in 0..200 {
                let r = total * f64::from(k) / 200.0;
                let (got, want) = (walk(&probs, r), walk_scan(&probs, r));
                // Only a draw within rounding of a boundary may land on a neighbour.
                match (got, want) {
                    (Some(g), Some(w)) => assert!(
                        g == w || (g as i64 - w as i64).abs() <= 7,
                        "n={n} r={r}: {g} vs {w}"
                    ),
                    (g, w) => assert_eq!(g, w, "n={n} r={r}"),
                }
                if let Some(g) = got {
                    assert!(probs[g as usize] > 0.0);
                }
            }
        }
    }

    #[test]
    fn a_large_vocabulary_draw_follows_temperature_and_min_p() {
        // 50k tokens: four likely ones and a tail at -1 whose mass (e^-8 of the top each,
        // ~17 tops in all) would take most draws without min-p; at temperature 0.5 and
        // min-p 0.01 only the four can be drawn, in proportion to exp(l / 0.5).
        let mut logits = vec![-1.0f32; 50_000];
        for (t, l) in [(11usize, 3.0f32), (20_000, 2.5), (35_001, 2.0), (49_999, 1.0)] {
            logits[t] = l;
        }
        let p =
            SamplingParams { temperature: 0.5, min_p: 0.01, seed: Some(3), ..Default::default() };
        let mut s = Sampler::new(logits.len());
        let mut st = SamplerState::new(&p, 0);
        let draws: Vec<u32> =
            (0..4000).map(|_| s.sample(&p, &mut st, &logits, false).token).collect();
        let w = |l: f32| (f64::from(l) / 0.5).exp();
        let z = w(3.0) + w(2.5) + w(2.0) + w(1.0);
        for (t, l) in [(11u32, 3.0f32), (20_000, 2.5), (35_001, 2.0)] {
            let freq = draws.iter().filter(|&&x| x == t).count() as f64 / draws.len() as f64;
            assert!((freq - w(l) / z).abs() < 0.03, "token {t}: {freq} vs {}", w(l) / z);
        }
        // exp((1 - 3) / 0.5) = 0.018 of the top: kept by min-p 0.01, rare but possible.
        assert!(draws.iter().all(|&t| [11, 20_000, 35_001, 49_999].contains(&t)));
        // Without min-p the tail takes its share (~17 / 19.4 of the mass).
        let free = SamplingParams { min_p: 0.0, ..p.clone() };
        let tail = (0..2000)
            .filter(|_| {
                let t = s.sample(&free, &mut st, &logits, false).token;
                ![11, 20_000, 35_001, 49_999].contains(&t)
            })
            .count();
        assert!(tail > 1500, "{tail} of 2000 from the tail");
        // A temperature whose inverse overflows f32 (1 / 1e-39): the greedy pick.
        let cold = SamplingParams { temperature: 1e-39, ..p.clone() };
        assert_eq!(s.sample(&cold, &mut st, &logits, false).token, 11);
        // Nothing allowed (every logit -inf): the first id, as greedy gives.
        let none = vec![f32::NEG_INFINITY; 100];
        assert_eq!(s.sample(&p, &mut st, &none, false).token, 0);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_draws_from_the_nucleus_in_proportion() {
        // 30k tokens with a long tail: the nucleus of 0.8 at temperature 0.7, computed here
        // by sorting everything, against the sampler's ranking of a thresholded set.
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut logits: Vec<f32> = (0..30_000).map(|_| rng.random::<f32>() * 4.0 - 6.0).collect();
        for (t, l) in [(5usize, 4.0f32), (17, 3.5), (29_000, 3.0), (12_345, 2.0), (400, 1.0)] {
            logits[t] = l;
        }
        let temp = 0.7f64;
        let w: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / temp).exp()).collect();
        let z: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let (mut acc, mut nucleus) = (0.0, Vec::new());
        for &i in &order {
            acc += w[i] / z;
            nucleus.push(i);
            if acc >= 0.8 {
                break;
            }
        }
        let zn: f64 = nucleus.iter().map(|&i| w[i]).sum();
        let p =
            SamplingParams { temperature: 0.7, top_p: 0.8, seed: Some(5), ..Default::default() };
        let mut s = Sampler::new(logits.len());
        let mut st = SamplerState::new(&p, 0);
        let draws: Vec<u32> =
            (0..4000).map(|_| s.sample(&p, &mut st, &logits, false).token).collect();
        assert!(
            draws.iter().all(|&t| nucleus.contains(&(t as usize))),
            "a draw outside the nucleus"
        );
        // A peaked one, whose nucleus the first threshold (p ≥ 1e-3) holds: 0.6 and 0.3 on
        // two tokens, 0.1 spread over the rest; top-p 0.8 keeps the two.
        let mut peaked = vec![0.0f32; 30_000];
        peaked[7] = (0.6f64 / (0.1 / 29_998.0)).ln() as f32;
        peaked[8] = (0.3f64 / (0.1 / 29_998.0)).ln() as f32;
        let q =
            SamplingParams { temperature: 1.0, top_p: 0.8, seed: Some(2), ..Default::default() };
        let d: Vec<u32> = (0..3000).map(|_| s.sample(&q, &mut st, &peaked, false).token).collect();
        assert!(d.iter().all(|&t| t == 7 || t == 8), "outside the nucleus");
        let f7 = d.iter().filter(|&&t| t == 7).count() as f64 / d.len() as f64;
        assert!((f7 - 2.0 / 3.0).abs() < 0.04, "{f7}");
        for &t in nucleus.iter().filter(|&&t| w[t] / zn > 0.05) {
            let freq =
                draws.iter().filter(|&&x| x as usize == t).count() as f64 / draws.len() as f64;
            assert!((freq - w[t] / zn).abs() < 0.03, "token {t}: {freq} vs {}", w[t] / zn);
        }
    }

    #[test]
    fn a_flat_nucleus_cut_by_bands_is_the_shortest_ranked_prefix() {
        // Flat distributions, whose nucleus holds tokens below 1e-3 (the banded cut), on a
        // grid of 1/64 so that many logits tie: the kept set is the shortest prefix of the
        // tokens ranked by logit (ties by id) whose probability reaches top-p, among those
        // min-p keeps (within ln(1 / min_p) tempered nats of the best), found here by
        // sorting everything; every draw lies in it. With min-p 0.2 at temperature 1.3 over
        // logits in [0, 3], the survivors hold ~0.888 of the mass: top-p 0.9 keeps them all
        // (no band is cut), top-p 0.5 cuts one.
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = 20_000;
        let cases = [
            (0.8f32, 0.95f32, 0.0f32, 2.0f32, false),
            (1.0, 0.5, 0.0, 1.0, false),
            (1.3, 0.9, 0.2, 3.0, true),
            (1.3, 0.5, 0.2, 3.0, false),
            (0.7, 0.99, 0.0, 0.5, false),
            (2.0, 0.3, 0.0, 8.0, false),
        ];
        for (case, (temp, top_p, min_p, spread, all_kept)) in cases.into_iter().enumerate() {
            let logits: Vec<f32> =
                (0..n).map(|_| (rng.random::<f32>() * spread * 64.0).round() / 64.0).collect();
            let p = SamplingParams {
                temperature: temp,
                top_p,
                min_p,
                seed: Some(case as u64),
                ..Default::default()
            };
            let mut s = Sampler::new(n);
            let mut st = SamplerState::new(&p, 0);
            let first = s.sample(&p, &mut st, &logits, false).token;
            let probs = s.probs.clone();
            let coarse: f64 =
                probs.iter().filter(|&&q| q >= 1e-3).map(|&q| f64::from(q)).sum::<f64>();
            assert!(coarse < f64::from(top_p), "case {case}: the ranked path would serve it");
            let best = argmax(&logits).0;
            let lmax = f64::from(logits[best as usize]);
            let reach = if min_p > 0.0 { (1.0 / f64::from(min_p)).ln() } else { f64::INFINITY };
            let survives = |i: usize| (lmax - f64::from(logits[i])) / f64::from(temp) <= reach;
            let zeroed = (0..n).filter(|&i| (probs[i] > 0.0) != survives(i)).count();
            assert_eq!(zeroed, 0, "case {case}: min-p kept the wrong tokens");
            let mut order: Vec<usize> = (0..n).filter(|&i| survives(i)).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let mut acc = 0.0f64;
            let mut expected = vec![false; n];
            for &i in &order {
                expected[i] = true;
                acc += f64::from(probs[i]);
                if acc >= f64::from(top_p) {
                    break;
                }
            }
            let cut = s.band_cut(&logits, best, 1.0 / temp, f64::from(top_p));
            assert_eq!(cut.cut == BANDS, all_kept, "case {case}: which path");
            let mut kept: Vec<bool> = s.band.iter().map(|&b| usize::from(b) < cut.cut).collect();
            for &i in &s.idx {
                kept[i as usize] = true;
            }
            let differ = (0..n).filter(|&i| kept[i] != expected[i]).count();
            assert_eq!(differ, 0, "case {case}: {differ} tokens differ from the ranked nucleus");
            assert!(expected[first as usize], "case {case}");
            for _ in 0..300 {
                let t = s.sample(&p, &mut st, &logits, false).token;
                assert!(expected[t as usize], "case {case}: {t} drawn outside the nucleus");
            }
        }
    }

    #[test]
    fn a_banded_draw_follows_the_nucleus_distribution() {
        // 2,000 flat tokens (each below 1e-3), top-p 0.9: the draws' shares of four id
        // ranges match the nucleus's (a walk that took each band's first token would favour
        // low ids), and the cut band's ranked part is drawn in proportion (a walk that took
        // its first token would give that token the whole part's share, ~5 times its own,
        // and never draw the last).
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        let n = 2_000;
        let logits: Vec<f32> = (0..n).map(|_| rng.random::<f32>()).collect();
        let p = SamplingParams { top_p: 0.9, seed: Some(4), ..Default::default() };
        let mut s = Sampler::new(n);
        let mut st = SamplerState::new(&p, 0);
        s.sample(&p, &mut st, &logits, false);
        assert!(s.probs.iter().all(|&q| q < 1e-3), "flat");
        let probs = s.probs.clone();
        let best = argmax(&logits).0;
        let cut = s.band_cut(&logits, best, 1.0, 0.9);
        assert!(cut.cut < BANDS && s.idx.len() >= 2, "a band is cut");
        let (part_first, part_last) = (s.idx[0] as usize, s.idx[s.idx.len() - 1] as usize);
        let mut kept: Vec<bool> = s.band.iter().map(|&b| usize::from(b) < cut.cut).collect();
        for &i in &s.idx {
            kept[i as usize] = true;
        }
        let total: f64 = (0..n).filter(|&i| kept[i]).map(|i| f64::from(probs[i])).sum();
        let mut want = [0.0f64; 4];
        for i in (0..n).filter(|&i| kept[i]) {
            want[4 * i / n] += f64::from(probs[i]) / total;
        }
        let draws = 40_000;
        let mut got = [0.0f64; 4];
        let (mut first, mut last) = (0usize, 0usize);
        for _ in 0..draws {
            let t = s.sample(&p, &mut st, &logits, false).token as usize;
            assert!(kept[t], "{t} drawn outside the nucleus");
            got[4 * t / n] += 1.0 / f64::from(draws);
            first += usize::from(t == part_first);
            last += usize::from(t == part_last);
        }
        for k in 0..4 {
            assert!((got[k] - want[k]).abs() < 0.02, "ids {k}/4: {} vs {}", got[k], want[k]);
        }
        let expect_first = f64::from(probs[part_first]) / total * f64::from(draws);
        assert!(
            (first as f64) < 2.5 * expect_first + 8.0 && last > 0,
            "the cut band's ranked part: its first token {first} draws ({expect_first:.1} \
             expected), its last {last}"
        );
    }

    #[test]
    fn log_probabilities_match_their_definition_and_the_top_list_a_full_ranking() {
        // ln Σ exp against an f64 sum, within the f32 rounding of the kernels' softmax; the
        // top-n list against sorting the whole vocabulary (logit descending, ties by id), on
        // logits with ties, -inf entries, and n beyond the vocabulary.
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut s = Sampler::new(50_000);
        let mut out = Vec::new();
        for (case, (n_vocab, spread, n)) in
            [(50_000usize, 1.0f32, 5usize), (50_000, 12.0, 20), (777, 3.0, 1), (9, 2.0, 40)]
                .into_iter()
                .enumerate()
        {
            let mut logits: Vec<f32> =
                (0..n_vocab).map(|_| (rng.random::<f32>() * spread * 8.0).round() / 8.0).collect();
            logits[n_vocab / 2] = f32::NEG_INFINITY;
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
            let want =
                f64::from(max) + logits.iter().map(|&l| f64::from(l - max).exp()).sum::<f64>().ln();
            let t = (n_vocab / 3) as u32;
            let got = f64::from(logits[t as usize] - s.score(&logits, t, n, &mut out));
            assert!((got - want).abs() < 1e-5 * want.abs().max(1.0), "case {case}: {got} {want}");
            let mut order: Vec<u32> = (0..n_vocab as u32).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
            });
            let ids: Vec<u32> = out.iter().map(|&(i, _)| i).collect();
            assert_eq!(ids, order[..n.min(n_vocab)], "case {case}");
            let mut top = Vec::new();
            s.top_logprobs(&logits, n, &mut top);
            assert_eq!(top, out, "case {case}: one normalizer for both");
        }
    }

    #[test]
    fn top_k_keeps_the_k_best_ranked_with_ties_by_id() {
        // Logits on a grid of 1/16 (many ties at every boundary), k on both sides of the
        // one-pass limit: the candidates are the first k of the whole vocabulary sorted by
        // logit (descending, ties by id), in that order, and draws come from them.
        let mut rng = ChaCha8Rng::seed_from_u64(41);
        let n = 5_000;
        let logits: Vec<f32> =
            (0..n).map(|_| (rng.random::<f32>() * 64.0).round() / 16.0).collect();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let mut s = Sampler::new(n);
        // The one pass on special values: ±0 straddling the k-th place, ±inf, ±NaN.
        let mut odd: Vec<f32> = (0..300).map(|i| [0.0, -0.0, 1.0, -1.0][i % 4]).collect();
        for (i, v) in [
            (3, f32::NAN),
            (17, -f32::NAN),
            (40, f32::INFINITY),
            (41, f32::NEG_INFINITY),
            (299, f32::NAN),
        ] {
            odd[i] = v;
        }
        let mut odd_order: Vec<u32> = (0..odd.len() as u32).collect();
        odd_order.sort_by(|&a, &b| odd[b as usize].total_cmp(&odd[a as usize]).then(a.cmp(&b)));
        for k in [1, 2, 3, 40, 80, 120, 200, 299, 300] {
            s.rank_top(&odd, k);
            assert_eq!(s.idx, odd_order[..k], "special values, k = {k}");
        }
        // A temperature so cold that the scaled logits overflow: the greedy pick, with top-k
        // as without.
        let cold = SamplingParams { temperature: 1e-39, top_k: 5, ..Default::default() };
        let mut st = SamplerState::new(&cold, 0);
        assert_eq!(s.sample(&cold, &mut st, &logits, false).token, order[0]);
        for k in [1, 7, 40, ONE_PASS_TOP, ONE_PASS_TOP + 1, 500] {
            let p = SamplingParams { top_k: k, seed: Some(k as u64), ..Default::default() };
            let mut st = SamplerState::new(&p, 0);
            let t = s.sample(&p, &mut st, &logits, false).token;
            assert_eq!(s.idx, order[..k], "k = {k}");
            assert!(order[..k].contains(&t), "k = {k}: {t} drawn outside the k best");
        }
    }

    #[test]
    fn a_far_tail_is_dropped_before_the_softmax_and_no_probability_is_subnormal() {
        // A mocker's row (one token 100 above a flat tail) and a cold temperature's: the
        // tail's probabilities would be e^-100 and e^-400, subnormal in f32.
        let n = 50_000;
        let mut logits = vec![0.0f32; n];
        logits[777] = 100.0;
        logits[4242] = 40.0;
        let mut s = Sampler::new(n);
        for (t, seed) in [(1.0f32, 1u64), (0.25, 2), (2.0, 3)] {
            let p = SamplingParams { temperature: t, seed: Some(seed), ..Default::default() };
            let mut st = SamplerState::new(&p, 0);
            for _ in 0..20 {
                assert_eq!(s.sample(&p, &mut st, &logits, false).token, 777);
            }
            assert!(s.probs.iter().all(|p| !p.is_subnormal()), "temperature {t}");
            // Within reach (60 nats at temperature 1, 30 at 2): kept, not zeroed.
            let kept = s.probs[4242];
            assert_eq!(kept > 0.0, t >= 1.0, "temperature {t}: {kept}");
            // The flat tail is beyond reach below temperature 1.43 (100 > 70·t).
            assert_eq!(s.probs[0] > 0.0, t * NEGLIGIBLE > 100.0, "temperature {t}");
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_truncates() {
        let logits = [0.0f32, 5.0, 4.9, -1.0];
        let mut s = Sampler::new(4);
        let p = SamplingParams { top_k: 1, seed: Some(1), ..Default::default() };
        let mut st = SamplerState::new(&p, 0);
        for _ in 0..50 {
            assert_eq!(s.sample(&p, &mut st, &logits, false).token, 1);
        }
        let p = SamplingParams { top_p: 0.5, seed: Some(1), ..Default::default() };
        let mut st = SamplerState::new(&p, 0);
        for _ in 0..50 {
            assert_eq!(s.sample(&p, &mut st, &logits, false).token, 1);
        }
        let p = SamplingParams { min_p: 0.5, seed: Some(3), ..Default::default() };
        let mut st = SamplerState::new(&p, 0);
        for _ in 0..200 {
            let t = s.sample(&p, &mut st, &logits, false).token;
            assert!(t == 1 || t == 2);
        }
    }

    #[test]
    fn penalties_follow_openai_and_ctrl_definitions() {
        let mut s = Sampler::new(5);
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut l = [1.0f32, 1.0, -1.0, 1.0, 1.0];
        s.apply_penalties(&p, &mut l, &[3], &[1, 1, 2]);
        assert_eq!(l[0], 1.0);
        assert_eq!(l[1], 1.0 / 2.0 - 0.5 - 0.5);
        assert_eq!(l[2], -2.0 - 0.5 - 0.25);
        assert_eq!(l[3], 0.5);
        assert_eq!(l[4], 1.0);
        // Counts are reset between calls.
        let mut l2 = [1.0f32; 5];
        s.apply_penalties(&p, &mut l2, &[], &[]);
        assert_eq!(l2, [1.0; 5]);
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().unwrap_err().contains("top_p"));
        let p = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert!(p.validate().unwrap_err().contains("temperature"));
        assert!(SamplingParams::default().validate().is_ok());
    }
}
