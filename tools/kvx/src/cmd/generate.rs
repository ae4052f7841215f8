//! `kvx generate` and `kvx tokenize`: run the model on the command line.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvx_engine::generate::{Finish, Generator};
use kvx_engine::sampler::SamplingParams;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::LlamaModel;
use kvx_tokenizer::{ChatMessage, DecodeStream, Tokenizer};

use super::Runtime;

#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    /// Prompt text (with `--chat`, the content of one user message).
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for `--chat` (the template's default when absent).
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below min_p times the top probability.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object: prompt_token_ids, token_ids, text, finish_reason.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelOpts,
}

#[derive(Debug, Args)]
pub(crate) struct ModelOpts {
    /// Model: a catalogue name or a path to a GGUF file (default model when absent).
    #[arg(long, env = "KVX_MODEL")]
    pub(crate) model: Option<String>,
    /// Kernel threads (default: all cores).
    #[arg(long, env = "KVX_THREADS")]
    pub(crate) threads: Option<usize>,
}

#[derive(Debug, Args)]
pub(crate) struct TokenizeArgs {
    /// Text to tokenize (with `--chat`, the content of one user message).
    #[arg(long)]
    text: String,
    /// Wrap the text as a user message through the chat template (with the generation prompt).
    #[arg(long)]
    chat: bool,
    /// System message for `--chat`.
    #[arg(long)]
    system: Option<String>,
    /// Treat special-token text (`<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Do not add the BOS/EOS tokens the model asks for.
    #[arg(long)]
    no_add_special: bool,
    #[arg(long, env = "KVX_MODEL")]
    model: Option<String>,
}

fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_gguf_path(path)
        .with_context(|| format!("loading the tokenizer of {}", path.display()))
}

/// The prompt text: raw, or one user turn through the chat template.
fn prompt_text(tok: &Tokenizer, text: &str, chat: bool, system: Option<&str>) -> Result<String> {
    if !chat {
        return Ok(text.to_string());
    }
    let Some(t) = tok.chat_template() else {
        match tok.chat_template_error() {
            Some(e) => bail!("the model's chat template does not compile: {e}"),
            None => bail!("the model has no chat template; drop --chat"),
        }
    };
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(ChatMessage::system(s));
    }
    msgs.push(ChatMessage::user(text));
    Ok(t.render(&msgs, true)?)
}

pub(crate) fn tokenize(args: TokenizeArgs, rt: &Runtime) -> Result<()> {
    let path = rt.store.resolve(args.model.as_deref())?;
    let tok = load_tokenizer(&path)?;
    let text = prompt_text(&tok, &args.text, args.chat, args.system.as_deref())?;
    let ids = if args.no_add_special {
        tok.encode(&text, !args.no_parse_special)?
    } else if args.no_parse_special {
        let mut ids = Vec::new();
        if tok.add_bos() {
            ids.extend(tok.bos_id());
        }
        ids.extend(tok.encode(&text, false)?);
        if tok.add_eos() {
            ids.extend(tok.eos_id());
        }
        ids
    } else {
        tok.encode_prompt(&text)?
    };
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

pub(crate) fn generate(args: GenerateArgs, rt: &Runtime) -> Result<()> {
    let path = rt.store.resolve(args.model.model.as_deref())?;
    let tok = load_tokenizer(&path)?;
    let text = prompt_text(&tok, &args.prompt, args.chat, args.system.as_deref())?;
    let prompt = tok.encode_prompt(&text)?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let model = Arc::new(LlamaModel::load(Arc::new(file))?);
    let threads = args.model.threads.unwrap_or(rt.cores);
    let mut g = Generator::new(model, rt.kernels()?, threads, prompt.len() + args.max_tokens)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        ..Default::default()
    };
    let mut stream = DecodeStream::new(true);
    let mut text_out = String::new();
    let stdout = std::io::stdout();
    let json = args.json;
    let ignore_eos = args.ignore_eos;
    let r = g.generate(
        &prompt,
        &params,
        args.max_tokens,
        |t| !ignore_eos && tok.is_eog(t),
        |t| {
            let before = text_out.len();
            if stream.step_into(&tok, t, &mut text_out).is_err() {
                return ControlFlow::Break(());
            }
            if !json {
                let mut out = stdout.lock();
                let _ = out.write_all(&text_out.as_bytes()[before..]);
                let _ = out.flush();
            }
            ControlFlow::Continue(())
        },
    )?;
    stream.finish(&mut text_out);
    let finish = match r.finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::Cancelled => bail!("generation stopped: a token could not be decoded"),
    };
    let n = r.tokens.len();
    if json {
        let v = serde_json::json!({
            "prompt_token_ids": prompt,
            "token_ids": r.tokens,
            "text": text_out,
            "finish_reason": finish,
        });
        println!("{v}");
    } else {
        println!();
    }
    let decode_tps = if n > 1 { (n - 1) as f64 / r.decode.as_secs_f64() } else { 0.0 };
    eprintln!(
        "kvx: prompt {} tokens in {:.1} ms ({:.0} tok/s), generated {n} tokens at {decode_tps:.1} tok/s, {finish}, kernels {}",
        prompt.len(),
        r.prefill.as_secs_f64() * 1e3,
        prompt.len() as f64 / r.prefill.as_secs_f64(),
        rt.kernels()?.level
    );
    Ok(())
}
