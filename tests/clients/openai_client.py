"""Drives `kvx serve` with the official `openai` Python client: chat and completions,
streaming and not, usage, and an error status. Usage: openai_client.py BASE_URL"""

import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")
checks = 0

model = client.models.list().data[0].id

r = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    max_tokens=8,
    temperature=0.7,
    seed=1,
)
assert r.object == "chat.completion", r
assert r.choices[0].message.role == "assistant"
assert isinstance(r.choices[0].message.content, str)
assert r.choices[0].finish_reason in ("stop", "length")
assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
assert r.usage.prompt_tokens_details.cached_tokens >= 0
checks += 1

chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
assert finish == ["length"], finish
assert chunks[-1].usage.completion_tokens == 10, chunks[-1]
assert text, chunks
checks += 1

r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, logprobs=2)
assert r.object == "text_completion"
assert r.usage.completion_tokens == 5
assert len(r.choices[0].logprobs.tokens) == 5
checks += 1

chunks = list(
    client.completions.create(
        model=model,
        prompt=["a b c", "d e f"],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
)
assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
assert chunks[-1].usage.completion_tokens == 8
checks += 1

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("expected a 404")
except openai.NotFoundError as e:
    assert e.status_code == 404
checks += 1

try:
    client.completions.create(model=model, prompt="x", max_tokens=10**6)
    raise AssertionError("expected a 400")
except openai.BadRequestError as e:
    assert "maximum context length" in str(e)
checks += 1

print(f"ok: {checks} checks")
