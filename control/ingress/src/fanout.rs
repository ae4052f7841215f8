//! `n` choices per prompt (the `n` of both endpoints): each choice is an engine request of its
//! own with the same prompt and a seed of its own. This module holds the pure parts: the
//! OpenAI index of a choice, the choices' seeds, and a response's usage, which counts each
//! prompt once (OpenAI's semantics) and sums the completion tokens of every choice.

use kvx_proto::Usage;

/// The OpenAI `index` of choice `j` of prompt `prompt` when each prompt has `n` choices
/// (`prompt * n + j`, as OpenAI numbers a list prompt's choices).
pub fn choice_index(prompt: usize, j: usize, n: usize) -> usize {
    prompt * n + j
}

/// The prompt and choice of OpenAI index `index` (the inverse of [`choice_index`]).
pub fn split_index(index: usize, n: usize) -> (usize, usize) {
    let n = n.max(1);
    (index / n, index % n)
}

/// The engine seeds of `n` choices: `seed, seed + 1, …` (wrapping) when the client gave one;
/// otherwise none for a single choice (the engine picks) and `random, random + 1, …` for
/// several, so that no two choices of a request share a seed.
pub fn seeds(seed: Option<u64>, n: usize, random: u64) -> Vec<Option<u64>> {
    match seed {
        Some(s) => (0..n as u64).map(|j| Some(s.wrapping_add(j))).collect(),
        None if n <= 1 => vec![None; n],
        None => (0..n as u64).map(|j| Some(random.wrapping_add(j))).collect(),
    }
}

/// A response's usage over its choices: prompt-side counts (prompt, cached, KV transfer) from
/// each prompt's first choice only, completion tokens summed over all of them.
#[derive(Debug, Default, Clone)]
pub struct UsageSum {
    total: Usage,
}

impl UsageSum {
    /// Adds the usage of choice `j` of a prompt.
    pub fn add(&mut self, j: usize, u: &Usage) {
        let t = &mut self.total;
        if j == 0 {
            t.prompt_tokens = t.prompt_tokens.saturating_add(u.prompt_tokens);
            t.cached_tokens = t.cached_tokens.saturating_add(u.cached_tokens);
            t.kv_transfer_us = t.kv_transfer_us.saturating_add(u.kv_transfer_us);
        }
        t.completion_tokens = t.completion_tokens.saturating_add(u.completion_tokens);
    }

    /// Adds a prompt that was answered without an engine request (`echo` with
    /// `max_tokens: 0`): its tokens, nothing generated.
    pub fn add_prompt(&mut self, prompt_tokens: usize) {
        let p = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        self.total.prompt_tokens = self.total.prompt_tokens.saturating_add(p);
    }

    /// The total.
    pub fn total(&self) -> &Usage {
        &self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_are_prompt_major_and_invert() {
        let n = 3;
        let mut seen = Vec::new();
        for p in 0..4 {
            for j in 0..n {
                let i = choice_index(p, j, n);
                assert_eq!(split_index(i, n), (p, j));
                seen.push(i);
            }
        }
        assert_eq!(seen, (0..12).collect::<Vec<_>>());
        assert_eq!(choice_index(2, 0, 1), 2);
        assert_eq!(split_index(5, 0), (5, 0));
    }

    #[test]
    fn seeds_are_distinct_and_follow_the_given_one() {
        assert_eq!(seeds(Some(1), 3, 99), vec![Some(1), Some(2), Some(3)]);
        assert_eq!(seeds(Some(u64::MAX), 2, 0), vec![Some(u64::MAX), Some(0)]);
        assert_eq!(seeds(None, 1, 99), vec![None]);
        let s = seeds(None, 16, u64::MAX - 3);
        let mut d: Vec<_> = s.iter().map(|x| x.unwrap()).collect();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), 16);
    }

    #[test]
    fn usage_counts_each_prompt_once_and_sums_completions() {
        let u = |p, c, cached| Usage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: cached,
            ..Default::default()
        };
        let mut s = UsageSum::default();
        // Two prompts (10 and 4 tokens) × 3 choices; the followers found the prompt cached.
        for (j, c) in [(0, 5), (1, 7), (2, 1)] {
            s.add(j, &u(10, c, if j == 0 { 0 } else { 8 }));
        }
        for (j, c) in [(0, 2), (1, 2), (2, 3)] {
            s.add(j, &u(4, c, 0));
        }
        let t = s.total();
        assert_eq!(t.prompt_tokens, 14);
        assert_eq!(t.completion_tokens, 20);
        assert_eq!(t.cached_tokens, 0);
        let mut e = UsageSum::default();
        e.add_prompt(6);
        e.add_prompt(usize::MAX);
        assert_eq!(e.total().prompt_tokens, u32::MAX);
        assert_eq!(e.total().completion_tokens, 0);
    }
}
