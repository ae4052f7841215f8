//! Pre-tokenizer rules per `tokenizer.ggml.pre`: the split regexes llama.cpp applies before
//! byte-level BPE, and the flags that come with each pre-tokenizer type.
//!
//! llama.cpp applies its regexes one after another, each splitting every piece the previous
//! ones produced, keeping both the matches and the text between them ("isolated" splits).
//! It evaluates them on text where every non-ASCII code point is first collapsed to its
//! Unicode category, so `\p{Lu}`, `\p{Ll}`, ... all mean "any letter" there; the regexes
//! below are given as llama.cpp states them and [`to_onig`] rewrites them so Oniguruma, on
//! the real text, matches exactly the same spans.

use tokenizers::SplitDelimiterBehavior;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use crate::error::{TokenizerError, backend};

/// The white space set llama.cpp's `\s` matches (Unicode White_Space), as an Oniguruma class
/// body, so the meaning does not depend on the regex engine's own tables.
const WS_CLASS: &str =
    r"\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}";

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const CONTRACTIONS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";

/// What a pre-tokenizer type implies for tokenization.
#[derive(Debug, Clone)]
pub(crate) struct PreSpec {
    /// The llama.cpp pre-tokenizer family, for messages.
    pub family: &'static str,
    /// Split regexes in llama.cpp's notation, applied in order.
    pub regexes: Vec<String>,
    /// Words that are whole vocabulary entries are not merged (llama3 and a few others).
    pub ignore_merges: bool,
    /// The add-BOS default before `tokenizer.ggml.add_bos_token` is read.
    pub add_bos: bool,
    /// The type clears the default BOS id before the GGUF keys are read.
    pub no_default_bos: bool,
}

impl PreSpec {
    fn new(family: &'static str, regexes: &[&str]) -> Self {
        PreSpec {
            family,
            regexes: regexes.iter().map(|s| (*s).to_owned()).collect(),
            ignore_merges: false,
            add_bos: false,
            no_default_bos: false,
        }
    }

    fn ignore_merges(mut self) -> Self {
        self.ignore_merges = true;
        self
    }

    fn add_bos(mut self) -> Self {
        self.add_bos = true;
        self
    }

    fn no_default_bos(mut self) -> Self {
        self.no_default_bos = true;
        self
    }
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value (`None`: the key is absent, which
/// llama.cpp treats as "default").
pub(crate) fn spec_for(pre: Option<&str>) -> Result<PreSpec, TokenizerError> {
    let llama3 = format!(
        r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let qwen2 = format!(
        r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let gpt4o_like = |marks: &str| {
        format!(
            r"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}{marks}])([^a-z]))*((?=[\p{{L}}{marks}])([^A-Z]))+{CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}{marks}])([^a-z]))+((?=[\p{{L}}{marks}])([^A-Z]))*{CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    };
    let deepseek3_main = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    let Some(pre) = pre else {
        return Ok(default_spec());
    };
    Ok(match pre {
        "default" => default_spec(),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => {
            PreSpec::new("llama3", &[&llama3]).ignore_merges().add_bos()
        }
        "dbrx" | "smaug-bpe" => PreSpec::new("llama3", &[&llama3]),
        "chatglm-bpe" => PreSpec::new("chatglm4", &[&llama3]).no_default_bos(),
        "glm4" | "glm5" => PreSpec::new("chatglm4", &[&llama3]).no_default_bos().ignore_merges(),
        "deepseek-coder" => PreSpec::new(
            "deepseek-coder",
            &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
        ),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => PreSpec::new(
            "deepseek-v3",
            &[r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", deepseek3_main],
        ),
        "falcon" => PreSpec::new(
            "falcon",
            &[
                r"[\p{P}\$\+<=>\^~\|`]+",
                GPT2,
                "[0-9][0-9][0-9]",
            ],
        ),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
        | "minerva-7b" | "mellum2" => PreSpec::new("starcoder", &[r"\p{N}", GPT2]),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe"
        | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => {
            PreSpec::new("gpt2", &[GPT2])
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" | "grok-2" => PreSpec::new("qwen2", &[&qwen2]),
        "qwen35" => PreSpec::new(
            "qwen35",
            &[&format!(
                r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )],
        ),
        "ufakzeka" => PreSpec::new(
            "ufakzeka",
            &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
        ),
        "seed-coder" => PreSpec::new(
            "seed-coder",
            &[&format!(
                r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1}}| ?[^\s\p{{L}}\p{{N}}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
            )],
        ),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => PreSpec::new(
            "bailingmoe",
            &[r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
        ),
        "poro-chat" | "bloom" | "gpt3-finnish" => {
            PreSpec::new("bloom", &[" ?[^(\\s|.,!?…。，、।۔،)]+"])
        }
        "viking" => PreSpec::new("viking", &[" ?[^(\\s|.,!?…。，、।۔،)]+", r"\p{N}"]),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => {
            PreSpec::new("gpt4o", &[&gpt4o_like("")])
        }
        "granite-embed-multi-97m" => {
            PreSpec::new("granite-emb-multi", &[&gpt4o_like(r"\p{M}")]).ignore_merges()
        }
        "tekken" => PreSpec::new(
            "tekken",
            &[r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
        )
        .ignore_merges()
        .add_bos(),
        "minicpm5" => PreSpec::new(
            "minicpm5",
            &[
                r"\p{N}{1,3}",
                &format!(
                    r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}+| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                ),
            ],
        )
        .ignore_merges(),
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "pre-tokenizer {other:?} (tokenizer.ggml.pre) is not implemented"
            )));
        }
    })
}

fn default_spec() -> PreSpec {
    PreSpec::new("default", &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"])
}

/// Rewrites a regex in llama.cpp's notation so Oniguruma matches the same spans on the real
/// text that llama.cpp matches on its category-collapsed text: letter subcategories become
/// `\p{L}`, and `\s` / `\S` become llama.cpp's white space set.
pub(crate) fn to_onig(re: &str) -> String {
    let mut out = String::with_capacity(re.len() + 64);
    let mut in_class = false;
    let mut chars = re.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                let Some((_, next)) = chars.next() else {
                    out.push('\\');
                    break;
                };
                match next {
                    's' => {
                        if in_class {
                            out.push_str(WS_CLASS);
                        } else {
                            out.push('[');
                            out.push_str(WS_CLASS);
                            out.push(']');
                        }
                    }
                    'S' if !in_class => {
                        out.push_str("[^");
                        out.push_str(WS_CLASS);
                        out.push(']');
                    }
                    'p' => {
                        // `\p` is two ASCII bytes; the category name follows in braces.
                        let rest = &re[i + 2..];
                        match ["{Lu}", "{Ll}", "{Lt}", "{Lm}", "{Lo}"]
                            .iter()
                            .find(|sub| rest.starts_with(**sub))
                        {
                            Some(sub) => {
                                out.push_str(r"\p{L}");
                                for _ in 0..sub.len() {
                                    chars.next();
                                }
                            }
                            None => out.push_str(r"\p"),
                        }
                    }
                    other => {
                        out.push('\\');
                        out.push(other);
                    }
                }
            }
            '[' if !in_class => {
                in_class = true;
                out.push('[');
                // A leading '^' or ']' belongs to the class syntax, not its end.
                if let Some(&(_, '^')) = chars.peek() {
                    out.push('^');
                    chars.next();
                }
            }
            ']' if in_class => {
                in_class = false;
                out.push(']');
            }
            '[' => out.push_str(r"\["),
            other => out.push(other),
        }
    }
    out
}

/// The `tokenizers` pre-tokenizer for a spec: each regex as an isolated split, then the GPT-2
/// byte-to-unicode mapping without a regex of its own.
pub(crate) fn build(spec: &PreSpec) -> Result<PreTokenizerWrapper, TokenizerError> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
    for re in &spec.regexes {
        let split =
            Split::new(SplitPattern::Regex(to_onig(re)), SplitDelimiterBehavior::Isolated, false)
                .map_err(backend)?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(steps).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn onig_rewrite() {
        assert_eq!(to_onig(r"\p{Lu}x\p{L}\p{N}"), r"\p{L}x\p{L}\p{N}");
        assert_eq!(to_onig(r"[^\s\p{L}]"), format!(r"[^{WS_CLASS}\p{{L}}]"));
        assert_eq!(to_onig(r"\s+(?!\S)"), format!(r"[{WS_CLASS}]+(?![^{WS_CLASS}])"));
        assert_eq!(to_onig(r"[\[\\\]]"), r"[\[\\\]]");
        assert_eq!(to_onig(" ?[^(\\s|.,)]+"), format!(" ?[^({WS_CLASS}|.,)]+"));
    }

    #[test]
    fn every_spec_compiles() {
        for pre in [
            None,
            Some("default"),
            Some("llama-bpe"),
            Some("dbrx"),
            Some("chatglm-bpe"),
            Some("glm4"),
            Some("deepseek-coder"),
            Some("deepseek-v3"),
            Some("falcon"),
            Some("smollm"),
            Some("gpt-2"),
            Some("qwen2"),
            Some("qwen35"),
            Some("ufakzeka"),
            Some("seed-coder"),
            Some("bailingmoe"),
            Some("bloom"),
            Some("viking"),
            Some("gpt-4o"),
            Some("granite-embed-multi-97m"),
            Some("tekken"),
            Some("minicpm5"),
        ] {
            let spec = spec_for(pre).unwrap();
            build(&spec).unwrap_or_else(|e| panic!("{pre:?}: {e}"));
        }
        assert!(matches!(spec_for(Some("nope")), Err(TokenizerError::Unsupported(_))));
    }
}
