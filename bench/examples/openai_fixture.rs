//! Standalone OpenAI-compatible fixture server (the one the end-to-end tests use), for
//! throughput checks of the load generator: `--itl-us 0 --ttft-us 0` is a zero-latency endpoint.
//!
//! Usage: `openai_fixture [--port N] [--ttft-us N] [--itl-us N] [--per-token-us N] [--block-size N]`

#[path = "../tests/support/openai_fixture.rs"]
mod openai_fixture;

use std::time::Duration;

use openai_fixture::FixtureConfig;

fn main() -> Result<(), String> {
    let mut cfg = FixtureConfig::default();
    let mut port = 8077u16;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<u64>().map_err(|_| format!("{flag}: not a number: {value}"));
        match flag.as_str() {
            "--port" => port = value.parse().map_err(|_| format!("bad port {value}"))?,
            "--ttft-us" => cfg.ttft = Duration::from_micros(num()?),
            "--itl-us" => cfg.itl = Duration::from_micros(num()?),
            "--per-token-us" => cfg.per_uncached_token = Duration::from_micros(num()?),
            "--block-size" => cfg.block_size = num()? as usize,
            "--model" => cfg.model = value,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .map_err(|e| format!("bind 127.0.0.1:{port}: {e}"))?;
        eprintln!("openai_fixture listening on http://127.0.0.1:{port}");
        openai_fixture::serve_forever(listener, cfg).await;
        Ok(())
    })
}
