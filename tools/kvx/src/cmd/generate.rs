//! `kvx generate` and `kvx tokenize`: run the model on the command line.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvx_proto::{FinishReason, GenerateRequest, RequestId, SamplingOptions, StopConditions, Usage};
use kvx_tokenizer::{ChatMessage, Tokenizer};
use kvx_worker::EngineKind;

use super::Runtime;
use super::engine::EngineOpts;

#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    /// Prompt text (with `--chat`, the content of one user message).
    #[arg(long, required_unless_present = "prompts_file", conflicts_with = "prompts_file")]
    prompt: Option<String>,
    /// A file with one prompt per line, run through one engine `--concurrency` at a time.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Requests in flight at once with `--prompts-file`.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
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
    /// Print JSON: one object `{prompt_token_ids, token_ids, text, finish_reason}` per prompt
    /// (one line each with `--prompts-file`, plus `index`, `ttft_ms`, `cached_tokens`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineOpts,
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

/// One prompt's progress through the engine.
struct Job {
    index: usize,
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    text: String,
    submitted: Instant,
    first: Option<Instant>,
    done: Option<Instant>,
    finish: Option<(FinishReason, Usage)>,
}

pub(crate) fn generate(args: GenerateArgs, rt: &Runtime) -> Result<()> {
    let concurrency = args.concurrency.max(1);
    let mut setup = args.engine.setup(rt, EngineKind::Model, true)?;
    setup.limits.max_num_seqs = setup.limits.max_num_seqs.min(concurrency);
    let prepared = setup.prepare()?;
    let tok = prepared.tokenizer().context("the model has no tokenizer")?;
    let texts: Vec<String> = match (&args.prompt, &args.prompts_file) {
        (Some(p), _) => vec![p.clone()],
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        (None, None) => bail!("give --prompt or --prompts-file"),
    };
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| Ok(tok.encode_prompt(&prompt_text(tok, t, args.chat, args.system.as_deref())?)?))
        .collect::<Result<_>>()?;
    let mut engine = prepared.engine(0)?;
    let sampling = SamplingOptions {
        temperature: args.temperature,
        top_k: args.top_k as u32,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        ..Default::default()
    };
    let single = args.prompts_file.is_none();
    let stdout = std::io::stdout();
    let mut jobs: Vec<Job> = Vec::with_capacity(prompts.len());
    let mut by_id: HashMap<RequestId, usize> = HashMap::new();
    let mut next = 0;
    let start = Instant::now();
    let mut done = 0;
    while done < prompts.len() {
        while next < prompts.len() && by_id.len() < concurrency {
            let req = GenerateRequest::new(
                RequestId(next as u64 + 1),
                prompts[next].clone(),
                sampling.clone(),
                StopConditions {
                    max_tokens: args.max_tokens as u32,
                    ignore_eos: args.ignore_eos,
                    ..Default::default()
                },
            );
            engine.add(&req).map_err(|e| anyhow::anyhow!("prompt {next}: {e}"))?;
            by_id.insert(req.id, jobs.len());
            jobs.push(Job {
                index: next,
                prompt: req.prompt,
                tokens: Vec::new(),
                text: String::new(),
                submitted: Instant::now(),
                first: None,
                done: None,
                finish: None,
            });
            next += 1;
        }
        let out = engine.step()?;
        for ev in &out.events {
            let Some(&j) = by_id.get(&ev.id) else { continue };
            let job = &mut jobs[j];
            if let Some(t) = ev.token {
                job.tokens.push(t);
                job.first.get_or_insert_with(Instant::now);
            }
            let text = out.text_of(ev);
            job.text.push_str(text);
            if single && !args.json {
                let mut o = stdout.lock();
                let _ = o.write_all(text.as_bytes());
                let _ = o.flush();
            }
            if let Some(reason) = ev.finish {
                job.finish = Some((reason, ev.usage));
                job.done = Some(Instant::now());
                by_id.remove(&ev.id);
                done += 1;
                if !single {
                    print_job(job, args.json)?;
                }
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    if single {
        if args.json {
            print_job_json(&jobs[0], false)?;
        } else {
            println!();
        }
    }
    let stats = engine.stats();
    let generated: usize = jobs.iter().map(|j| j.tokens.len()).sum();
    let ttft: Vec<f64> = jobs
        .iter()
        .filter_map(|j| j.first.map(|f| (f - j.submitted).as_secs_f64() * 1e3))
        .collect();
    let mean_ttft = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
    eprintln!(
        "kvx: {} request(s), {generated} tokens generated in {wall:.2} s ({:.1} tok/s), prompt tokens {} ({} computed, {} from the prefix cache), mean TTFT {mean_ttft:.1} ms, {} preemption(s), kernels {}, {} arithmetic",
        jobs.len(),
        generated as f64 / wall,
        stats.prompt_tokens,
        stats.prefill_tokens,
        stats.cached_tokens,
        stats.preemptions,
        rt.kernels()?.label(),
        prepared.setup().effective_arith().name()
    );
    Ok(())
}

fn print_job(job: &Job, json: bool) -> Result<()> {
    if json {
        return print_job_json(job, true);
    }
    println!("--- [{}] {}\n{}", job.index, job.finish.map_or("?", |(r, _)| r.as_str()), job.text);
    Ok(())
}

fn print_job_json(job: &Job, batch: bool) -> Result<()> {
    let (reason, usage) = job.finish.unwrap_or((FinishReason::Length, Usage::default()));
    let mut v = serde_json::json!({
        "prompt_token_ids": job.prompt,
        "token_ids": job.tokens,
        "text": job.text,
        "finish_reason": reason.as_str(),
    });
    if batch {
        v["index"] = job.index.into();
        v["cached_tokens"] = usage.cached_tokens.into();
        v["ttft_ms"] = job.first.map_or(0.0, |f| (f - job.submitted).as_secs_f64() * 1e3).into();
        v["e2e_ms"] = job.done.map_or(0.0, |d| (d - job.submitted).as_secs_f64() * 1e3).into();
    }
    println!("{v}");
    Ok(())
}
