//! Micro-benchmark of the per-token hot path: SSE framing plus chunk parsing of a streamed chat
//! response, against the plain approach (split lines, parse each chunk into a `serde_json::Value`)
//! in the same run.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_bench::sse::{SseParser, parse_chunk};

fn stream(tokens: usize) -> Vec<u8> {
    let mut s = String::new();
    s.push_str("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n");
    for i in 0..tokens {
        s.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" word{i}\\n\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        ));
    }
    s.push_str("data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":256,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

/// Network-sized pieces (what a socket read returns).
fn pieces(bytes: &[u8], size: usize) -> Vec<&[u8]> {
    bytes.chunks(size).collect()
}

fn ours(parts: &[&[u8]], parser: &mut SseParser) -> usize {
    let mut n = 0;
    parser.reset();
    for p in parts {
        let _ = parser.feed(p, |ev| {
            if ev != b"[DONE]"
                && let Ok(c) = parse_chunk(ev)
                && c.has_content()
            {
                n += 1;
            }
        });
    }
    n
}

fn plain(parts: &[&[u8]]) -> usize {
    let mut buf = Vec::new();
    let mut n = 0;
    for p in parts {
        buf.extend_from_slice(p);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(data) = line.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(_) => continue,
            };
            if v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
                n += 1;
            }
        }
    }
    n
}

fn bench(c: &mut Criterion) {
    let bytes = stream(256);
    let parts = pieces(&bytes, 1460);
    let mut parser = SseParser::new();
    assert_eq!(ours(&parts, &mut parser), 256);
    assert_eq!(plain(&parts), 256);
    let mut g = c.benchmark_group("sse_256_tokens");
    g.throughput(Throughput::Elements(256));
    g.bench_function("kvx_bench", |b| b.iter(|| ours(black_box(&parts), &mut parser)));
    g.bench_function("plain_serde_value", |b| b.iter(|| plain(black_box(&parts))));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
