"""Tool calls through the official `openai` client against kvx: with tool_choice "required"
and naming each tool, streamed and not, every answer must carry a tool call whose arguments
validate against the tool's parameter schema (jsonschema). Prints `ok: N calls`."""

import json
import sys

import jsonschema
from openai import OpenAI

base_url = sys.argv[1]
client = OpenAI(base_url=base_url, api_key="none")
model = client.models.list().data[0].id

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add_event",
        "description": "Add an event to the calendar",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 60},
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20},
                          "minItems": 1, "maxItems": 3}},
            "required": ["title", "day", "attendees"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_currency",
        "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
            "from": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
            "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]}},
            "required": ["amount", "from", "to"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_web",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60},
            "filters": {"type": "object", "properties": {
                "site": {"type": "string", "maxLength": 30},
                "recent": {"type": "boolean"}},
                "required": ["recent"], "additionalProperties": False}},
            "required": ["query", "filters"], "additionalProperties": False}}},
]
PROMPTS = {
    "get_weather": "What is the weather like in Paris right now?",
    "add_event": "Put a team lunch with Ana and Bo on my calendar for the 12th.",
    "convert_currency": "How much is 250 euros in US dollars?",
    "search_web": "Find recent news about the James Webb telescope on nasa.gov.",
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(prompt, choice, stream):
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
              tool_choice=choice, max_tokens=200, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        calls = ch.message.tool_calls
        assert calls and len(calls) >= 1, ch.message
        return [(c.id, c.function.name, c.function.arguments) for c in calls]
    calls = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                c["id"] = d.id
            if d.function and d.function.name:
                c["name"] += d.function.name
            if d.function and d.function.arguments:
                c["arguments"] += d.function.arguments
        assert not (ch.delta.content or ""), f"content streamed beside a forced call: {ch.delta}"
        finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    assert calls, "no tool call streamed"
    return [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


n = 0
for name, prompt in PROMPTS.items():
    for choice in ("required", {"type": "function", "function": {"name": name}}):
        for stream in (False, True):
            for cid, fname, args in ask(prompt, choice, stream):
                assert cid, "a call without an id"
                assert fname in SCHEMAS, fname
                if isinstance(choice, dict):
                    assert fname == name, (fname, name)
                jsonschema.validate(json.loads(args), SCHEMAS[fname])
                n += 1
                print(f"{'stream' if stream else 'whole '} {json.dumps(choice)[:40]:40} {fname}({args})")
print(f"ok: {n} calls")
