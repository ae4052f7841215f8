"""Drives `kvx serve --tls-cert --tls-key` with the official `openai` Python client over
HTTPS: a chat completion whole and streamed with a client that trusts the test CA, and a
refused connection for a client that does not. Usage: openai_tls.py BASE_URL CA_PEM"""

import ssl
import sys

import openai

try:  # the package openai's own requirements name
    import httpx2 as httpx
except ImportError:
    import httpx

base, ca = sys.argv[1], sys.argv[2]
checks = 0

trusting = httpx.Client(verify=ssl.create_default_context(cafile=ca))
client = openai.OpenAI(base_url=base, api_key="unused", http_client=trusting)
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Say hello."}]

r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
assert r.object == "chat.completion", r
assert r.choices[0].message.content, r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert 0 < r.usage.completion_tokens <= 8, r.usage
checks += 1

chunks = list(
    client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
# Greedy decoding: the stream says what the whole response said.
assert text == r.choices[0].message.content, (text, r)
assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens, chunks[-1]
checks += 1

# The system's trust store (not the test CA): the handshake fails, nothing is sent.
untrusting = openai.OpenAI(
    base_url=base, api_key="unused", max_retries=0, http_client=httpx.Client()
)
try:
    untrusting.models.list()
    raise AssertionError("a client that does not trust the CA got an answer")
except openai.APIConnectionError as e:
    chain, c = [], e
    while c is not None and len(chain) < 10:
        chain.append(c)
        c = c.__cause__ or c.__context__
    why = " / ".join(f"{type(c).__name__}: {c}" for c in chain)
    assert any(
        isinstance(c, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(c)
        for c in chain
    ), why
checks += 1

print(f"ok: {checks} checks")
