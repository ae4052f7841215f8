//! Tool calls: a chat request's `tools` and `tool_choice` checked, the grammar a forced call
//! must match (`required`, or a named function: one call whose `arguments` follow the
//! function's `parameters` schema), and the generated text turned into OpenAI `tool_calls` —
//! the forced call's JSON, or, with `auto`, the `<tool_call>{...}</tool_call>` blocks (or a
//! bare call object) a model trained for tools writes.

use serde_json::{Value, json};

use crate::error::ApiError;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// The JSON schema of its arguments.
    pub parameters: Value,
}

/// What the request lets the model do with its tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text; no call is parsed.
    None,
    /// Call a tool or answer in text (calls are parsed out of the text).
    Auto,
    /// Call one of the tools (the output is constrained to a call).
    Required,
    /// Call this tool (the output is constrained to a call of it).
    Named(String),
}

/// A call, as OpenAI returns it: `arguments` is the JSON text of the arguments object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// Longest function name OpenAI accepts.
const MAX_NAME: usize = 64;
/// Most tools in one request.
const MAX_TOOLS: usize = 128;

fn bad(msg: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(msg, Some(param))
}

/// The request's tools and choice, checked: `tools` an array of
/// `{"type":"function","function":{"name","description"?,"parameters"?}}` with distinct names;
/// `tool_choice` `"none"`, `"auto"`, `"required"` or `{"type":"function","function":{"name"}}`
/// naming one of them (default `auto` with tools, `none` without).
pub fn parse(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<(Vec<Tool>, ToolChoice), ApiError> {
    let mut out = Vec::new();
    match tools {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            if list.len() > MAX_TOOLS {
                return Err(bad(format!("at most {MAX_TOOLS} tools"), "tools"));
            }
            for t in list {
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(bad("each tool must be {\"type\": \"function\", ...}", "tools"));
                }
                let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                    bad("a tool of type function needs a `function` object", "tools")
                })?;
                let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                let valid = !name.is_empty()
                    && name.len() <= MAX_NAME
                    && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if !valid {
                    return Err(bad(
                        format!("tool name {name:?}: 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -"),
                        "tools",
                    ));
                }
                if out.iter().any(|x: &Tool| x.name == name) {
                    return Err(bad(format!("two tools are named {name:?}"), "tools"));
                }
                let parameters = match f.get("parameters") {
                    None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                    Some(p @ Value::Object(_)) => p.clone(),
                    Some(_) => {
                        return Err(bad(
                            format!("the parameters of {name:?} must be a JSON schema object"),
                            "tools",
                        ));
                    }
                };
                out.push(Tool { name: name.to_string(), parameters });
            }
        }
        Some(_) => return Err(bad("tools must be an array", "tools")),
    }
    let choice = match choice {
        None | Some(Value::Null) => {
            if out.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    format!("tool_choice {other:?}: none, auto, required or a function"),
                    "tool_choice",
                ));
            }
        },
        Some(v @ Value::Object(_)) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad("tool_choice as an object is {\"type\":\"function\",\"function\":{\"name\":...}}", "tool_choice")
                })?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(bad("tool_choice must be a string or an object", "tool_choice")),
    };
    match &choice {
        ToolChoice::Required if out.is_empty() => {
            return Err(bad("tool_choice \"required\" needs tools", "tool_choice"));
        }
        ToolChoice::Named(n) if !out.iter().any(|t| &t.name == n) => {
            return Err(bad(
                format!("tool_choice names {n:?}, which is not in tools"),
                "tool_choice",
            ));
        }
        _ => {}
    }
    Ok((out, choice))
}

/// The schema of one call of `t`: `{"name": <t's name>, "arguments": <its parameters>}`.
/// The parameters' own definitions (`$defs`, `definitions`: what Pydantic writes) move to
/// `defs` under `<tool>.<name>`, their references rewritten, because nested under
/// `arguments` a root-relative `#/$defs/...` would no longer resolve.
fn call_schema(t: &Tool, defs: &mut serde_json::Map<String, Value>) -> Value {
    let mut params = t.parameters.clone();
    if let Value::Object(p) = &mut params {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = p.remove(key) {
                for (name, def) in d {
                    defs.insert(format!("{}.{name}", t.name), def);
                }
            }
        }
    }
    rewrite_refs(&mut params, &t.name);
    for (k, v) in defs.iter_mut() {
        if k.starts_with(&format!("{}.", t.name)) {
            rewrite_refs(v, &t.name);
        }
    }
    json!({
        "type": "object",
        "properties": {
            "name": {"const": t.name},
            "arguments": params,
        },
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// Points `#/$defs/X` and `#/definitions/X` references at `#/$defs/<tool>.X`.
fn rewrite_refs(v: &mut Value, tool: &str) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get_mut("$ref") {
                let name = r.strip_prefix("#/$defs/").or_else(|| r.strip_prefix("#/definitions/"));
                if let Some(name) = name {
                    *r = format!("#/$defs/{tool}.{name}");
                }
            }
            for (_, x) in m.iter_mut() {
                rewrite_refs(x, tool);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, tool)),
        _ => {}
    }
}

/// The JSON schema a forced call must match (`required`: a call of any tool; named: a call
/// of that one), as JSON text; `None` when nothing is forced.
pub fn forced_schema(tools: &[Tool], choice: &ToolChoice) -> Option<String> {
    let mut defs = serde_json::Map::new();
    let mut schema = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Named(n) => call_schema(tools.iter().find(|t| &t.name == n)?, &mut defs),
        ToolChoice::Required if tools.len() == 1 => call_schema(&tools[0], &mut defs),
        ToolChoice::Required => {
            let calls: Vec<Value> = tools.iter().map(|t| call_schema(t, &mut defs)).collect();
            json!({"anyOf": calls})
        }
    };
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    Some(schema.to_string())
}

/// A call object `{"name": ..., "arguments": {...}}` (`arguments` may also be a JSON string,
/// or `parameters` as some models write it) naming one of `tools`.
fn call_of(v: &Value, tools: &[Tool]) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?;
    if !tools.iter().any(|t| t.name == name) {
        return None;
    }
    let args = v.get("arguments").or_else(|| v.get("parameters"))?;
    let arguments = match args {
        Value::String(s) => {
            serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?.to_string()
        }
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some(ToolCall { name: name.to_string(), arguments })
}

/// The call a forced output holds (the grammar made it one); `None` if the output was cut
/// short (`length`) before the call was complete.
pub fn parse_forced(text: &str, tools: &[Tool]) -> Option<ToolCall> {
    call_of(&serde_json::from_str::<Value>(text.trim()).ok()?, tools)
}

/// With `auto`: the calls in a free answer — `<tool_call>{...}</tool_call>` blocks, or the
/// whole answer being one call object — and the text left around them (`None` when only
/// calls were written). Text that holds no valid call is returned as it is.
pub fn parse_auto(text: &str, tools: &[Tool]) -> (Option<String>, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut s = text;
    while let Some(i) = s.find(OPEN) {
        let after = &s[i + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
            None => (after, ""),
        };
        match serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| call_of(&v, tools)) {
            Some(c) => {
                rest.push_str(&s[..i]);
                calls.push(c);
            }
            None => {
                rest.push_str(&s[..i + OPEN.len()]);
                rest.push_str(body);
                if after.contains(CLOSE) {
                    rest.push_str(CLOSE);
                }
            }
        }
        s = next;
    }
    rest.push_str(s);
    if calls.is_empty()
        && let Some(c) =
            serde_json::from_str::<Value>(text.trim()).ok().and_then(|v| call_of(&v, tools))
    {
        return (None, vec![c]);
    }
    let rest = rest.trim();
    (if rest.is_empty() { None } else { Some(rest.to_string()) }, calls)
}

/// The `tool_calls` array of a response: `call_<request>_<i>` ids.
pub fn calls_json(calls: &[ToolCall], request_id: &str) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": format!("call_{request_id}_{i}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect(),
    )
}

/// A chat request's tools as its response needs them.
#[derive(Debug, Clone)]
pub struct ToolMode {
    /// The tools.
    pub tools: Vec<Tool>,
    /// Whether the output is constrained to one call (`required` or a named function).
    pub forced: bool,
}

impl ToolMode {
    /// The mode of a checked choice; `None` for [`ToolChoice::None`].
    pub fn new(tools: Vec<Tool>, choice: &ToolChoice) -> Option<Self> {
        match choice {
            ToolChoice::None => None,
            ToolChoice::Auto => Some(Self { tools, forced: false }),
            ToolChoice::Required | ToolChoice::Named(_) => Some(Self { tools, forced: true }),
        }
    }

    /// A whole answer: the content left and the calls.
    pub fn split(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        if self.forced {
            match parse_forced(text, &self.tools) {
                Some(c) => (None, vec![c]),
                None => (Some(text.to_string()), Vec::new()),
            }
        } else {
            parse_auto(text, &self.tools)
        }
    }
}

/// A streamed answer split as it arrives: text that cannot be (the start of) a call is
/// streamed as content at once; from a `<tool_call>` on (or, with a forced call, from the
/// start) text is held and turned into calls at the end.
#[derive(Debug, Default)]
pub struct StreamSplit {
    held: String,
    holding: bool,
    emitted: bool,
}

const OPEN_TAG: &str = "<tool_call>";

impl StreamSplit {
    /// Takes a delta's text; returns what may be streamed as content now.
    pub fn push(&mut self, mode: &ToolMode, text: &str) -> String {
        self.held.push_str(text);
        if mode.forced || self.holding {
            self.holding = true;
            return String::new();
        }
        // A whole answer that is a bare call object starts with `{`.
        if !self.emitted && self.held.trim_start().starts_with('{') {
            self.holding = true;
            return String::new();
        }
        if let Some(i) = self.held.find(OPEN_TAG) {
            self.holding = true;
            let out: String = self.held.drain(..i).collect();
            self.emitted |= !out.is_empty();
            return out;
        }
        // Keep back a tail that may be the start of the tag.
        let keep = (1..OPEN_TAG.len())
            .rev()
            .find(|&k| {
                self.held.is_char_boundary(self.held.len().saturating_sub(k))
                    && self.held.len() >= k
                    && OPEN_TAG.starts_with(&self.held[self.held.len() - k..])
            })
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out: String = self.held.drain(..cut).collect();
        self.emitted |= !out.trim().is_empty();
        out
    }

    /// At the end: the content still to stream and the calls.
    pub fn finish(self, mode: &ToolMode) -> (Option<String>, Vec<ToolCall>) {
        if self.held.is_empty() {
            return (None, Vec::new());
        }
        if mode.forced {
            return mode.split(&self.held);
        }
        let (content, calls) = parse_auto(&self.held, &mode.tools);
        if calls.is_empty() {
            // Nothing was a call: all of it is content, as written.
            return (Some(self.held), calls);
        }
        (content, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}])
    }

    #[test]
    fn tools_and_choices_parse_and_bad_ones_are_named() {
        let (t, c) = parse(Some(&weather()), None).unwrap();
        assert_eq!((t.len(), c), (2, ToolChoice::Auto));
        assert_eq!(t[1].parameters, json!({"type": "object", "properties": {}}));
        let (_, c) = parse(None, None).unwrap();
        assert_eq!(c, ToolChoice::None);
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        assert_eq!(
            parse(Some(&weather()), Some(&named)).unwrap().1,
            ToolChoice::Named("get_time".into())
        );
        for (tools, choice, needle) in [
            (json!({}), json!("auto"), "array"),
            (json!([{"type": "code"}]), json!("auto"), "function"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                json!("auto"),
                "tool name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a"}},
                    {"type": "function", "function": {"name": "a"}}]),
                json!("auto"),
                "two tools",
            ),
            (json!([]), json!("required"), "needs tools"),
            (weather(), json!({"type": "function", "function": {"name": "nope"}}), "not in tools"),
            (weather(), json!("sometimes"), "tool_choice"),
        ] {
            let e = parse(Some(&tools), Some(&choice)).unwrap_err();
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
    }

    #[test]
    fn forced_schemas_name_the_function_and_carry_its_parameters() {
        let (t, _) = parse(Some(&weather()), None).unwrap();
        assert_eq!(forced_schema(&t, &ToolChoice::Auto), None);
        let s: Value = serde_json::from_str(
            &forced_schema(&t, &ToolChoice::Named("get_weather".into())).unwrap(),
        )
        .unwrap();
        assert_eq!(s["properties"]["name"]["const"], "get_weather");
        assert_eq!(s["properties"]["arguments"]["required"], json!(["city"]));
        let any: Value =
            serde_json::from_str(&forced_schema(&t, &ToolChoice::Required).unwrap()).unwrap();
        assert_eq!(any["anyOf"].as_array().unwrap().len(), 2);
    }

    fn stream(mode: &ToolMode, parts: &[&str]) -> (String, Option<String>, Vec<ToolCall>) {
        let mut sp = StreamSplit::default();
        let mut out = String::new();
        for p in parts {
            out.push_str(&sp.push(mode, p));
        }
        let (rest, calls) = sp.finish(mode);
        (out, rest, calls)
    }

    #[test]
    fn streamed_answers_hold_back_only_what_may_be_a_call() {
        let (t, _) = parse(Some(&weather()), None).unwrap();
        let auto = ToolMode::new(t.clone(), &ToolChoice::Auto).unwrap();
        // Plain text streams through whole, even with a `<` that starts no call.
        let (out, rest, calls) = stream(&auto, &["Hello <b>wor", "ld</b> and <tool", "s> too"]);
        assert_eq!(out + rest.as_deref().unwrap_or(""), "Hello <b>world</b> and <tools> too");
        assert!(calls.is_empty());
        // A call split over deltas: the text before it streams, the call is held.
        let (out, rest, calls) = stream(
            &auto,
            &["Sure. <tool_", "call>{\"name\": \"get_time\", ", "\"arguments\": {}}</tool_call>"],
        );
        assert_eq!(out, "Sure. ");
        assert_eq!(rest, None);
        assert_eq!(calls[0].name, "get_time");
        // A bare call object as the whole answer.
        let (out, _, calls) = stream(&auto, &["{\"name\": \"get_time\",", " \"arguments\": {}}"]);
        assert_eq!((out.as_str(), calls.len()), ("", 1));
        // Forced: nothing streams as content.
        let forced = ToolMode::new(t, &ToolChoice::Required).unwrap();
        let (out, rest, calls) = stream(
            &forced,
            &["{\"name\": \"get_weather\", \"arguments\": ", "{\"city\": \"Rome\"}}"],
        );
        assert_eq!(
            (out.as_str(), rest, calls[0].arguments.as_str()),
            ("", None, r#"{"city":"Rome"}"#)
        );
        // Multi-byte text next to the tag's first byte.
        let (out, rest, _) = stream(&auto, &["héllo ", "wörld<"]);
        assert_eq!(out + rest.as_deref().unwrap_or(""), "héllo wörld<");
    }

    #[test]
    fn definitions_move_to_the_root_and_references_follow() {
        // Two tools whose parameters each define `Item` (as Pydantic writes them).
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {
                "type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}},
                "$defs": {"Item": {"type": "object", "properties": {"k": {"$ref": "#/$defs/Leaf"}}},
                          "Leaf": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {
                "type": "object", "properties": {"y": {"$ref": "#/definitions/Item"}},
                "definitions": {"Item": {"type": "string"}}}}}]);
        let (t, _) = parse(Some(&tools), None).unwrap();
        let s: Value =
            serde_json::from_str(&forced_schema(&t, &ToolChoice::Required).unwrap()).unwrap();
        let defs = s["$defs"].as_object().unwrap();
        assert_eq!(defs.len(), 3, "{s}");
        assert_eq!(defs["b.Item"], json!({"type": "string"}));
        assert_eq!(defs["a.Item"]["properties"]["k"]["$ref"], "#/$defs/a.Leaf");
        let args = &s["anyOf"][0]["properties"]["arguments"];
        assert_eq!(args["properties"]["x"]["$ref"], "#/$defs/a.Item");
        assert!(args.get("$defs").is_none(), "{args}");
        assert_eq!(
            s["anyOf"][1]["properties"]["arguments"]["properties"]["y"]["$ref"],
            "#/$defs/b.Item"
        );
    }

    #[test]
    fn outputs_become_calls() {
        let (t, _) = parse(Some(&weather()), None).unwrap();
        let c = parse_forced(r#" {"name": "get_weather", "arguments": {"city": "Paris"}} "#, &t)
            .unwrap();
        assert_eq!(
            c,
            ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }
        );
        assert_eq!(parse_forced(r#"{"name": "get_weather", "argu"#, &t), None, "cut short");
        let (content, calls) = parse_auto(
            "Let me check.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            &t,
        );
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 1);
        let (content, calls) =
            parse_auto(r#"{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}"#, &t);
        assert_eq!((content, calls[0].arguments.as_str()), (None, r#"{"city":"Oslo"}"#));
        let (content, calls) = parse_auto("<tool_call>{\"name\": \"unknown\"}</tool_call> hi", &t);
        assert!(calls.is_empty());
        assert_eq!(content.as_deref(), Some("<tool_call>{\"name\": \"unknown\"}</tool_call> hi"));
        let ids = calls_json(&[ToolCall { name: "f".into(), arguments: "{}".into() }], "r1");
        assert_eq!(ids[0]["id"], "call_r1_0");
        assert_eq!(ids[0]["function"]["arguments"], "{}");
    }
}
