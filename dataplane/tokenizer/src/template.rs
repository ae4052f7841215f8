//! Chat templates: Jinja templates from model metadata rendered with minijinja the way Hugging
//! Face transformers renders them with jinja2 (`apply_chat_template`).
//!
//! What transformers sets up, and what is mirrored here: `trim_blocks` and `lstrip_blocks`,
//! loop controls, the `{% generation %}` tag (its body is rendered unchanged),
//! `raise_exception(message)`, `strftime_now(format)`, and a `tojson` filter that is
//! Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)` rather than Jinja's HTML-safe one. Python string and dict methods
//! (`.strip()`, `.split()`, `.items()`, ...) come from minijinja-contrib's pycompat layer.
//! The variables are `messages`, `tools`, `documents` (none unless given),
//! `add_generation_prompt`, `bos_token`, `eos_token`, and any extra ones the caller adds.
//!
//! Known differences from jinja2: looping over `none` gives nothing instead of an error, and
//! `strftime_now` formats the current UTC time (transformers formats local time).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::TemplateError;

/// One chat message, shaped like an OpenAI chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The content; absent or null (e.g. an assistant message with only tool calls) is `None`.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Any other fields (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, ...),
    /// passed to the template as they are.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Message content: a string, or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed parts (`{"type": "text", "text": ...}`, ...).
    Parts(Vec<ContentPart>),
}

/// One typed content part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// The part type; only `text` parts carry text a template can use.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Other fields, passed through.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            extra: serde_json::Map::new(),
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Options of one render beyond the messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// Append the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Tool definitions (`tools`; none when absent, as in transformers).
    pub tools: Option<serde_json::Value>,
    /// Documents for retrieval-augmented templates (`documents`).
    pub documents: Option<serde_json::Value>,
    /// More template variables (`enable_thinking`, ...). They may replace `bos_token` and
    /// `eos_token` but not the variables above.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    typed_content: bool,
    clock: Arc<Clock>,
}

/// Where `strftime_now` reads the time.
#[derive(Debug, Default)]
struct Clock {
    fixed: std::sync::OnceLock<i64>,
}

impl Clock {
    fn now(&self) -> i64 {
        match self.fixed.get() {
            Some(&t) => t,
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0),
        }
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("typed_content", &self.typed_content)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat";
const PROBE_MARKER: &str = "kvx-typed-content-probe";

/// The error a template raises through `raise_exception`, carried through minijinja.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts templates see as
    /// `bos_token` / `eos_token`.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let source = source.into();
        let clock = Arc::new(Clock::default());
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", |message: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, "raise_exception called")
                .with_source(Raised(message)))
        });
        let fn_clock = Arc::clone(&clock);
        env.add_function("strftime_now", move |format: String| -> Value {
            Value::from(strftime(&format, fn_clock.now()))
        });
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(&source))
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        let mut t = ChatTemplate {
            source,
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            typed_content: false,
            clock,
        };
        t.typed_content = t.probe_typed_content();
        Ok(t)
    }

    /// Makes `strftime_now` report this moment (Unix seconds, UTC) instead of the clock, for
    /// reproducible renders.
    pub fn with_fixed_time(self, unix_seconds: i64) -> Self {
        let _ = self.clock.fixed.set(unix_seconds);
        self
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` text templates see.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The `eos_token` text templates see.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Whether the template reads list-of-parts content itself. When it does not, the text
    /// parts of a message are joined with newlines into one string first.
    pub fn supports_typed_content(&self) -> bool {
        self.typed_content
    }

    /// Renders a conversation.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, &RenderOptions { add_generation_prompt, ..Default::default() })
    }

    /// Renders a conversation with tools, documents or extra variables.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        let msgs: Vec<serde_json::Value> =
            messages.iter().map(|m| self.message_value(m)).collect::<Result<_, _>>()?;
        self.render_json(serde_json::Value::Array(msgs), options)
    }

    fn message_value(&self, m: &ChatMessage) -> Result<serde_json::Value, TemplateError> {
        let mut obj = serde_json::Map::new();
        obj.insert("role".into(), serde_json::Value::String(m.role.clone()));
        let content = match &m.content {
            None => serde_json::Value::Null,
            Some(MessageContent::Text(s)) => serde_json::Value::String(s.clone()),
            Some(MessageContent::Parts(parts)) if self.typed_content => {
                serde_json::to_value(parts).map_err(|e| TemplateError::Input(e.to_string()))?
            }
            Some(MessageContent::Parts(parts)) => {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter(|p| p.kind == "text")
                    .map(|p| p.text.as_deref().unwrap_or(""))
                    .collect();
                serde_json::Value::String(texts.join("\n"))
            }
        };
        obj.insert("content".into(), content);
        for (k, v) in &m.extra {
            if k != "role" && k != "content" {
                obj.insert(k.clone(), v.clone());
            }
        }
        Ok(serde_json::Value::Object(obj))
    }

    fn render_json(
        &self,
        messages: serde_json::Value,
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        for (k, v) in &options.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), options.tools.clone().unwrap_or(serde_json::Value::Null));
        ctx.insert(
            "documents".into(),
            options.documents.clone().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("add_generation_prompt".into(), options.add_generation_prompt.into());
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        template.render(Value::from(minijinja::value::Serde(&ctx))).map_err(|e| classify(&e))
    }

    /// Renders one user message whose content is a single text part and checks whether the
    /// text comes out as text (rather than as the printed list, or not at all).
    fn probe_typed_content(&self) -> bool {
        let parts = serde_json::json!([{
            "role": "user",
            "content": [{"type": "text", "text": PROBE_MARKER}],
        }]);
        match self.render_json(parts, &RenderOptions::default()) {
            Ok(out) => {
                out.contains(PROBE_MARKER) && !out.contains("\"type\"") && !out.contains("'type'")
            }
            Err(_) => false,
        }
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    if let Some(detail) = e.detail()
        && !s.contains(detail)
    {
        let _ = write!(s, ": {detail}");
    }
    s
}

fn classify(e: &minijinja::Error) -> TemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return TemplateError::Raised(r.0.clone());
        }
        source = err.source();
    }
    TemplateError::Render(describe(e))
}

/// Turns `{% generation %}` / `{% endgeneration %}` (a transformers extension) into an
/// always-true `if` block, keeping the whitespace-control markers, so the body renders
/// unchanged and trim/lstrip behave as for any block tag.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

// ----- tojson: Python's json.dumps -----

fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson indent must be an integer or a string",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_owned(), b.to_owned()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

const MAX_JSON_DEPTH: usize = 128;

fn write_json(
    out: &mut String,
    v: &Value,
    o: &JsonOpts,
    depth: usize,
) -> Result<(), minijinja::Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: nesting too deep"));
    }
    match v.kind() {
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(
                ErrorKind::UndefinedError,
                "tojson: an undefined value is not JSON serializable",
            ));
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float_repr(f));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), o.ensure_ascii),
        ValueKind::Bytes => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: bytes are not JSON serializable",
            ));
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, o, depth + 1);
                match k.as_str() {
                    Some(s) => write_json_str(out, s, o.ensure_ascii),
                    None => {
                        // Python turns int/float/bool/None keys into strings.
                        let text = if k.is_none() {
                            "null".to_owned()
                        } else if k.kind() == ValueKind::Bool {
                            (if k.is_true() { "true" } else { "false" }).to_owned()
                        } else {
                            k.to_string()
                        };
                        write_json_str(out, &text, o.ensure_ascii);
                    }
                }
                out.push_str(&o.key_sep);
                write_json(out, &v.get_item(k)?, o, depth + 1)?;
            }
            newline(out, o, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Plain | ValueKind::Invalid => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, o, depth + 1);
                write_json(out, item, o, depth + 1)?;
            }
            newline(out, o, depth);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value is not JSON serializable",
            ));
        }
    }
    Ok(())
}

fn newline(out: &mut String, o: &JsonOpts, depth: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in positional notation for
/// decimal exponents -4 ..= 15 and scientific notation (`1e+16`, `1.5e-05`) otherwise; json
/// writes the non-finite values as `NaN`, `Infinity`, `-Infinity`.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    let n = digits.len() as i32;
    // Decimal point position relative to the digits: value = 0.DIGITS * 10^decpt.
    let decpt = exp + 1;
    if (-4 < decpt) && (decpt <= 16) {
        if decpt <= 0 {
            out.push_str("0.");
            for _ in 0..(-decpt) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            for _ in 0..(decpt - n) {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        let _ = write!(out, "e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    out
}

// ----- strftime_now -----

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] =
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// A UTC moment broken down (proleptic Gregorian calendar).
struct Civil {
    year: i64,
    month: u32, // 1..=12
    day: u32,   // 1..=31
    hour: u32,
    minute: u32,
    second: u32,
    weekday: u32, // 0 = Monday
    yday: u32,    // 1..=366
}

fn civil(unix: i64) -> Civil {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400) as u32;
    // Days since 1970-01-01 to a date, by eras of 400 years (146097 days).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        hour: secs / 3600,
        minute: secs / 60 % 60,
        second: secs % 60,
        // 1970-01-01 was a Thursday.
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

/// `strftime` for the directives chat templates use; others are copied as they are, and
/// the zone directives are empty as for Python's naive `datetime.now()`.
pub(crate) fn strftime(format: &str, unix: i64) -> String {
    let t = civil(unix);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(mut d) = chars.next() else {
            out.push('%');
            break;
        };
        // glibc's "%-d": no padding.
        let pad = if d == '-' {
            match chars.next() {
                Some(n) => {
                    d = n;
                    false
                }
                None => {
                    out.push_str("%-");
                    break;
                }
            }
        } else {
            true
        };
        let num = |out: &mut String, v: i64, width: usize| {
            if pad {
                let _ = write!(out, "{v:0width$}");
            } else {
                let _ = write!(out, "{v}");
            }
        };
        let hour12 = if t.hour.is_multiple_of(12) { 12 } else { t.hour % 12 };
        match d {
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100), 2),
            'm' => num(&mut out, t.month.into(), 2),
            'd' => num(&mut out, t.day.into(), 2),
            'e' => {
                let _ = write!(out, "{:>2}", t.day);
            }
            'H' => num(&mut out, t.hour.into(), 2),
            'I' => num(&mut out, hour12.into(), 2),
            'M' => num(&mut out, t.minute.into(), 2),
            'S' => num(&mut out, t.second.into(), 2),
            'j' => num(&mut out, t.yday.into(), 3),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'B' => out.push_str(MONTHS[(t.month - 1) as usize]),
            'b' | 'h' => out.push_str(&MONTHS[(t.month - 1) as usize][..3]),
            'A' => out.push_str(WEEKDAYS[t.weekday as usize]),
            'a' => out.push_str(&WEEKDAYS[t.weekday as usize][..3]),
            'u' => num(&mut out, (t.weekday + 1).into(), 1),
            'w' => num(&mut out, ((t.weekday + 1) % 7).into(), 1),
            'D' => {
                let _ = write!(out, "{:02}/{:02}/{:02}", t.month, t.day, t.year.rem_euclid(100));
            }
            'F' => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            'T' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            'R' => {
                let _ = write!(out, "{:02}:{:02}", t.hour, t.minute);
            }
            'Z' | 'z' => {}
            '%' => out.push('%'),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            other => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e300, "1e+300"),
            (2.71, "2.71"),
            (f64::INFINITY, "Infinity"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
            (12345.678, "12345.678"),
        ] {
            assert_eq!(python_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime("%A, %B %-d, %Y %I:%M %p", t), "Thursday, February 29, 2024 01:05 PM");
        assert_eq!(
            strftime("%j %a %u %w %y %e %D %F %T %%", t),
            "060 Thu 4 4 24 29 02/29/24 2024-02-29 13:05:09 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %a", -86_400), "1969-12-31 Wed");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime("%Q%", 0), "%Q%");
    }

    #[test]
    fn generation_tags_become_blocks() {
        assert_eq!(
            rewrite_generation_tags("a{% generation %}b{%- endgeneration -%}c{% if x %}"),
            "a{% if true %}b{%- endif -%}c{% if x %}"
        );
        assert_eq!(rewrite_generation_tags("{% unclosed"), "{% unclosed");
    }
}
