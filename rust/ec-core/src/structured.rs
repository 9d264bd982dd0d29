//! Structured outputs and tools: `response_format`, vLLM's `structured_outputs`,
//! Responses' `text.format`, `tools`, `tool_choice` and `parallel_tool_calls`.
//!
//! Here their shape is checked and normalized into one object
//! ([`ParsedRequest::structured`](crate::request::ParsedRequest)); the grammar itself
//! (a JSON schema, a regex, a Lark grammar) is compiled in Python by the constrained
//! decoding library, which reports its errors against the `param` carried here.
//!
//! The normalized object:
//! `{"constraint": null | {"kind", "spec", "param"}, "tools": null | [{"name",
//! "description", "parameters", "strict"}], "tool_choice": "none" | "auto" |
//! "required" | "function", "tool_name": null | name, "parallel_tool_calls": bool}`
//! where `kind` is `json`, `json_object`, `regex`, `choice`, `grammar` or
//! `structural_tag` (spec `{"structures": [{"begin", "schema", "end"}], "triggers"}`).

use std::borrow::Cow;
use std::collections::HashSet;

use crate::content::clip;
use crate::error::Result;
use crate::fields::{array, boolean, missing, object, present, string, type_error, value_error};
use crate::fieldset::{Fields, F};
use crate::json::parse_str;
use crate::limits::Limits;
use crate::path::{Path, ROOT};
use crate::request::Endpoint;
use crate::value::{OwnedValue, Value};

/// Longest tool name (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;

fn s(text: &str) -> OwnedValue {
    Value::String(Cow::Owned(text.to_owned()))
}

fn obj(members: Vec<(&'static str, OwnedValue)>) -> OwnedValue {
    Value::Object(
        members
            .into_iter()
            .map(|(k, v)| (Cow::Borrowed(k), v))
            .collect(),
    )
}

fn constraint(kind: &str, spec: OwnedValue, param: &Path<'_>) -> OwnedValue {
    obj(vec![
        ("kind", s(kind)),
        ("spec", spec),
        ("param", s(&param.render())),
    ])
}

/// The `type` string of an object.
fn typed<'v, 'a>(v: &'v Value<'a>, path: &Path<'_>) -> Result<&'v str> {
    object(v, path)?;
    let tp = path.key("type");
    string(present(v.get("type")).ok_or_else(|| missing(&tp))?, &tp)
}

/// A JSON schema given inline: an object (or `true`/`false`), or for vLLM's
/// `structured_outputs.json`, a string holding one.
fn schema(v: &Value<'_>, path: &Path<'_>, string_ok: bool) -> Result<OwnedValue> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.to_owned_value()),
        Value::String(_) if string_ok => Ok(v.to_owned_value()),
        other => Err(type_error(path, "a JSON schema object", other)),
    }
}

/// `strict` of a schema or a tool: a boolean when present.
fn check_strict(v: &Value<'_>, path: &Path<'_>) -> Result<()> {
    match present(v.get("strict")) {
        Some(b) => boolean(b, &path.key("strict")).map(drop),
        None => Ok(()),
    }
}

/// A `json_schema` format: `{name, schema, strict, description}` (chat nests it under
/// `json_schema`, Responses' `text.format` holds it flat).
fn json_schema_format(
    v: &Value<'_>,
    path: &Path<'_>,
    schema_required: bool,
) -> Result<Option<OwnedValue>> {
    object(v, path)?;
    let np = path.key("name");
    string(present(v.get("name")).ok_or_else(|| missing(&np))?, &np)?;
    check_strict(v, path)?;
    let sp = path.key("schema");
    match present(v.get("schema")) {
        Some(x) => Ok(Some(constraint("json", schema(x, &sp, false)?, &sp))),
        None if schema_required => Err(missing(&sp)),
        None => Ok(None),
    }
}

/// A `{"type": ...}` output format: `text` (no constraint), `json_object`, or
/// `json_schema`, read by `json_schema` (named `what` in errors).
fn output_format(
    v: &Value<'_>,
    path: &Path<'_>,
    what: &str,
    json_schema: impl FnOnce() -> Result<Option<OwnedValue>>,
) -> Result<Option<OwnedValue>> {
    match typed(v, path)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(constraint("json_object", Value::Null, path))),
        "json_schema" => json_schema(),
        other => {
            let also = if what == "response_format" {
                ", json_schema or structural_tag"
            } else {
                " or json_schema"
            };
            Err(value_error(
                &path.key("type"),
                format!(
                    "unsupported {what} type '{}': expected text, json_object{also}",
                    clip(other)
                ),
            ))
        }
    }
}

/// A set of non-empty strings that answers "does this text start with one of them?"
/// in one binary search (a scan of every trigger for every structure would cost their
/// product).
///
/// The strings are kept sorted by their bytes and prefix-free: one that starts with
/// another is dropped, since any text it begins, the shorter one begins too. If some
/// kept `p` begins `text`, every string between `p` and `text` in byte order starts
/// with `p` too, so the greatest kept string not above `text` is `p` itself: that one
/// is the only candidate.
struct Prefixes<'a>(Vec<&'a str>);

impl<'a> Prefixes<'a> {
    fn new(mut all: Vec<&'a str>) -> Self {
        all.sort_unstable();
        let mut kept: Vec<&'a str> = Vec::with_capacity(all.len());
        for p in all {
            if !kept.last().is_some_and(|k| p.starts_with(k)) {
                kept.push(p);
            }
        }
        Prefixes(kept)
    }

    fn begins(&self, text: &str) -> bool {
        let below = self.0.partition_point(|p| *p <= text);
        below > 0 && text.starts_with(self.0[below - 1])
    }
}

/// A structural tag: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`
/// (vLLM's form, which its llguidance backend serves). The text is free until a
/// trigger appears; from there a structure's `begin`, JSON valid for its `schema`, and
/// its `end` are forced. Each `begin` must start with one of the triggers. The `format`
/// form (xgrammar's tag tree) is refused by name.
fn structural_tag(v: &Value<'_>, path: &Path<'_>) -> Result<OwnedValue> {
    object(v, path)?;
    if present(v.get("format")).is_some() {
        return Err(value_error(
            &path.key("format"),
            "the 'format' form of structural tags is not supported: give 'structures' \
             (begin, schema, end) and 'triggers'",
        ));
    }
    let tp = path.key("triggers");
    let items = array(present(v.get("triggers")).ok_or_else(|| missing(&tp))?, &tp)?;
    let mut triggers = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = tp.index(i);
        let t = string(item, &at)?;
        if t.is_empty() {
            return Err(value_error(&at, "a trigger must not be empty"));
        }
        triggers.push(t);
    }
    if triggers.is_empty() {
        return Err(value_error(&tp, "'triggers' must not be empty"));
    }
    let starts = Prefixes::new(triggers.clone());
    let sp = path.key("structures");
    let items = array(
        present(v.get("structures")).ok_or_else(|| missing(&sp))?,
        &sp,
    )?;
    if items.is_empty() {
        return Err(value_error(&sp, "'structures' must not be empty"));
    }
    let mut structures = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = sp.index(i);
        object(item, &at)?;
        let text = |key: &'static str| -> Result<OwnedValue> {
            let kp = at.key(key);
            Ok(s(string(
                present(item.get(key)).ok_or_else(|| missing(&kp))?,
                &kp,
            )?))
        };
        let (begin, end) = (text("begin")?, text("end")?);
        let begin_text = match &begin {
            Value::String(b) => b.as_ref(),
            _ => "",
        };
        if !starts.begins(begin_text) {
            return Err(value_error(
                &at.key("begin"),
                format!(
                    "'begin' ('{}') must start with one of 'triggers'",
                    clip(begin_text)
                ),
            ));
        }
        let kp = at.key("schema");
        let schema = schema(
            present(item.get("schema")).ok_or_else(|| missing(&kp))?,
            &kp,
            false,
        )?;
        structures.push(obj(vec![
            ("begin", begin),
            ("schema", schema),
            ("end", end),
        ]));
    }
    Ok(obj(vec![
        ("structures", Value::Array(structures)),
        (
            "triggers",
            Value::Array(triggers.into_iter().map(s).collect()),
        ),
    ]))
}

/// `response_format` (chat, completions): the schema nested under `json_schema`; one
/// without a schema constrains to any object.
fn response_format(v: &Value<'_>, path: &Path<'_>) -> Result<Option<OwnedValue>> {
    if typed(v, path)? == "structural_tag" {
        return Ok(Some(constraint(
            "structural_tag",
            structural_tag(v, path)?,
            path,
        )));
    }
    output_format(v, path, "response_format", || {
        let jp = path.key("json_schema");
        let inner = present(v.get("json_schema")).ok_or_else(|| missing(&jp))?;
        Ok(Some(json_schema_format(inner, &jp, false)?.unwrap_or_else(
            || constraint("json_object", Value::Null, &jp),
        )))
    })
}

/// Responses' `text`: `{"format": {...}}`, the schema held flat in the format.
fn text_config(v: &Value<'_>, path: &Path<'_>) -> Result<Option<OwnedValue>> {
    object(v, path)?;
    let fp = path.key("format");
    match present(v.get("format")) {
        None => Ok(None),
        Some(format) => output_format(format, &fp, "text.format", || {
            json_schema_format(format, &fp, true)
        }),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
/// `json_object` (other keys are options, ignored as vLLM's model ignores extras).
fn structured_outputs(v: &Value<'_>, path: &Path<'_>) -> Result<Option<OwnedValue>> {
    object(v, path)?;
    let mut found: Vec<OwnedValue> = Vec::new();
    if let Some(x) = present(v.get("json")) {
        let p = path.key("json");
        found.push(constraint("json", schema(x, &p, true)?, &p));
    }
    if let Some(x) = present(v.get("regex")) {
        let p = path.key("regex");
        found.push(constraint("regex", s(string(x, &p)?), &p));
    }
    if let Some(x) = present(v.get("choice")) {
        let p = path.key("choice");
        let items = array(x, &p)?;
        if items.is_empty() {
            return Err(value_error(
                &p,
                format!("'{}' must not be empty", p.render()),
            ));
        }
        let mut choices = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            choices.push(s(string(item, &p.index(i))?));
        }
        found.push(constraint("choice", Value::Array(choices), &p));
    }
    if let Some(x) = present(v.get("grammar")) {
        let p = path.key("grammar");
        found.push(constraint("grammar", s(string(x, &p)?), &p));
    }
    if let Some(x) = present(v.get("json_object")) {
        let p = path.key("json_object");
        if boolean(x, &p)? {
            found.push(constraint("json_object", Value::Null, &p));
        }
    }
    if let Some(x) = present(v.get("structural_tag")) {
        // vLLM's field is the tag's JSON text; an object is taken as well.
        let p = path.key("structural_tag");
        let spec = match x {
            Value::String(text) => {
                let parsed = parse_str(text, &Limits::default()).map_err(|e| {
                    value_error(&p, format!("'{}' is not valid JSON: {e}", p.render()))
                })?;
                structural_tag(&parsed, &p)?
            }
            other => structural_tag(other, &p)?,
        };
        found.push(constraint("structural_tag", spec, &p));
    }
    match found.len() {
        0 => Err(value_error(
            path,
            "'structured_outputs' must set one of json, regex, choice, grammar, json_object or \
             structural_tag",
        )),
        1 => Ok(found.pop()),
        _ => Err(value_error(
            path,
            "'structured_outputs' may set only one of json, regex, choice, grammar, json_object \
             or structural_tag",
        )),
    }
}

fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOOL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// One tool: chat nests the function under `function`, Responses holds it flat.
fn tool<'v>(
    v: &'v Value<'_>,
    path: &Path<'_>,
    endpoint: Endpoint,
) -> Result<(&'v str, OwnedValue)> {
    let tp = path.key("type");
    let kind = typed(v, path)?;
    if kind != "function" {
        return Err(value_error(
            &tp,
            format!("unsupported tool type '{}': expected function", clip(kind)),
        ));
    }
    let fp = path.key("function");
    let (f, at) = match endpoint {
        Endpoint::Responses => (v, *path),
        _ => (present(v.get("function")).ok_or_else(|| missing(&fp))?, fp),
    };
    object(f, &at)?;
    let np = at.key("name");
    let name = string(present(f.get("name")).ok_or_else(|| missing(&np))?, &np)?;
    if !valid_tool_name(name) {
        return Err(value_error(
            &np,
            format!(
                "invalid tool name '{}': 1 to {MAX_TOOL_NAME} letters, digits, '_', '-' or '.'",
                clip(name)
            ),
        ));
    }
    let dp = at.key("description");
    let description = match present(f.get("description")) {
        Some(d) => s(string(d, &dp)?),
        None => Value::Null,
    };
    let pp = at.key("parameters");
    let parameters = match present(f.get("parameters")) {
        Some(p) => schema(p, &pp, false)?,
        None => Value::Null,
    };
    check_strict(f, &at)?;
    let strict = match present(f.get("strict")) {
        Some(b) => Value::Bool(boolean(b, &at.key("strict"))?),
        None => Value::Bool(false),
    };
    let normalized = obj(vec![
        ("name", s(name)),
        ("description", description),
        ("parameters", parameters),
        ("strict", strict),
    ]);
    Ok((name, normalized))
}

/// `tool_choice`: the mode and, for a named function, its name (checked against `names`).
fn tool_choice(
    v: &Value<'_>,
    path: &Path<'_>,
    endpoint: Endpoint,
    names: &HashSet<&str>,
) -> Result<(&'static str, Option<String>)> {
    let (mode, name) = match v {
        Value::String(m) => match m.as_ref() {
            "none" => ("none", None),
            "auto" => ("auto", None),
            "required" => ("required", None),
            other => {
                return Err(value_error(
                    path,
                    format!(
                        "unsupported tool_choice '{}': expected none, auto, required or a \
                         named function",
                        clip(other)
                    ),
                ))
            }
        },
        Value::Object(_) => {
            let tp = path.key("type");
            let kind = typed(v, path)?;
            if kind != "function" {
                return Err(value_error(
                    &tp,
                    format!(
                        "unsupported tool_choice type '{}': expected function",
                        clip(kind)
                    ),
                ));
            }
            let fp = path.key("function");
            let (f, at) = match endpoint {
                Endpoint::Responses => (v, *path),
                _ => (present(v.get("function")).ok_or_else(|| missing(&fp))?, fp),
            };
            object(f, &at)?;
            let np = at.key("name");
            let name = string(present(f.get("name")).ok_or_else(|| missing(&np))?, &np)?;
            if !names.contains(name) {
                return Err(value_error(
                    &np,
                    format!(
                        "tool_choice names the function '{}', which is not in 'tools'",
                        clip(name)
                    ),
                ));
            }
            ("function", Some(name.to_owned()))
        }
        other => {
            return Err(type_error(
                path,
                "a string or a named function object",
                other,
            ))
        }
    };
    // As vLLM: on chat any choice but `none` needs tools; Responses defaults to `auto`.
    let free = mode == "none" || (mode == "auto" && endpoint == Endpoint::Responses);
    if names.is_empty() && !free {
        return Err(value_error(
            path,
            format!("tool_choice '{mode}' needs 'tools'"),
        ));
    }
    Ok((mode, name))
}

/// The structured-output and tool fields of a chat, completions or Responses body;
/// `None` when the request sets none of them (or only harmless values).
pub fn structured(fields: &Fields<'_, '_>, endpoint: Endpoint) -> Result<Option<OwnedValue>> {
    let mut constraint_from: Option<(OwnedValue, &'static str)> = None;
    let mut set = |c: Option<OwnedValue>, name: &'static str| -> Result<()> {
        let Some(c) = c else { return Ok(()) };
        if let Some((_, other)) = &constraint_from {
            return Err(value_error(
                &ROOT.key(name),
                format!("'{name}' and '{other}' cannot both constrain the output"),
            ));
        }
        constraint_from = Some((c, name));
        Ok(())
    };
    if let Some(v) = fields.get(F::ResponseFormat) {
        set(
            response_format(v, &ROOT.key("response_format"))?,
            "response_format",
        )?;
    }
    if let Some(v) = fields.get(F::Text) {
        set(text_config(v, &ROOT.key("text"))?, "text")?;
    }
    if let Some(v) = fields.get(F::StructuredOutputs) {
        set(
            structured_outputs(v, &ROOT.key("structured_outputs"))?,
            "structured_outputs",
        )?;
    }

    let tp = ROOT.key("tools");
    // A set: checking each name against a list of the earlier ones would cost the
    // square of the number of tools.
    let mut names: HashSet<&str> = HashSet::new();
    let tools = match fields.get(F::Tools) {
        None => None,
        Some(v) => {
            let items = array(v, &tp)?;
            if items.is_empty() {
                return Err(value_error(
                    &tp,
                    "'tools' must not be empty (leave it out for no tools)",
                ));
            }
            let mut out = Vec::with_capacity(items.len());
            names.reserve(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = tp.index(i);
                let (name, normalized) = tool(item, &at, endpoint)?;
                if !names.insert(name) {
                    return Err(value_error(
                        &at,
                        format!("two tools are named '{}'", clip(name)),
                    ));
                }
                out.push(normalized);
            }
            Some(Value::Array(out))
        }
    };
    let cp = ROOT.key("tool_choice");
    let (mode, name) = match fields.get(F::ToolChoice) {
        Some(v) => tool_choice(v, &cp, endpoint, &names)?,
        None if tools.is_some() => ("auto", None),
        None => ("none", None),
    };
    if matches!(mode, "required" | "function") {
        if let Some((_, other)) = &constraint_from {
            return Err(value_error(
                &cp,
                format!("tool_choice '{mode}' and '{other}' cannot both constrain the output"),
            ));
        }
    }
    let parallel = match fields.get(F::ParallelToolCalls) {
        Some(v) => boolean(v, &ROOT.key("parallel_tool_calls"))?,
        None => true,
    };
    if constraint_from.is_none() && tools.is_none() {
        return Ok(None);
    }
    Ok(Some(obj(vec![
        (
            "constraint",
            constraint_from.map_or(Value::Null, |(c, _)| c),
        ),
        ("tools", tools.unwrap_or(Value::Null)),
        ("tool_choice", s(mode)),
        ("tool_name", name.map_or(Value::Null, |n| s(&n))),
        ("parallel_tool_calls", Value::Bool(parallel)),
    ])))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binary search against a scan of every trigger, over sets of short triggers
    /// (prefixes of each other, repeats, multi-byte characters) and texts around them.
    #[test]
    fn prefixes_answer_as_a_scan_does() {
        let alphabet = ["a", "b", "ab", "é", "<", "<t", "<t1>", "ba", "aa"];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let word = |next: &mut dyn FnMut(usize) -> usize| -> String {
            (0..1 + next(3))
                .map(|_| alphabet[next(alphabet.len())])
                .collect()
        };
        for _ in 0..2000 {
            let triggers: Vec<String> = (0..1 + next(6)).map(|_| word(&mut next)).collect();
            let refs: Vec<&str> = triggers.iter().map(String::as_str).collect();
            let set = Prefixes::new(refs.clone());
            for _ in 0..20 {
                let text = if next(4) == 0 {
                    String::new()
                } else {
                    word(&mut next)
                };
                let want = refs.iter().any(|t| text.starts_with(t));
                assert_eq!(set.begins(&text), want, "{refs:?} {text:?}");
            }
        }
    }

    #[test]
    fn tool_names() {
        assert!(valid_tool_name("get_weather"));
        assert!(valid_tool_name("a-b.c"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name("with space"));
        assert!(!valid_tool_name(&"x".repeat(MAX_TOOL_NAME + 1)));
    }
}
