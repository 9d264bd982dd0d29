//! Body bytes -> [`Value`], with every failure mapped to a typed [`RequestError`].
//!
//! serde_json does the tokenizing; a seeded visitor builds the borrowed tree and
//! enforces the depth and string-size limits while it goes, so a 10,000-deep body is
//! refused after [`Limits::effective_depth`] levels without deep recursion.
//!
//! Integers beyond 64 bits: serde_json hands them over as (rounded) floats. The visitor
//! notes when a float could be such an integer, and only then a second scan of the
//! text restores the exact digits of every integer literal that overflowed. Integers
//! beyond the float range (over 308 digits) are refused as out of range.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::error::{RequestError, Result};
use crate::limits::Limits;
use crate::value::{Number, Value};

/// Parse state shared by the visitors of one body.
struct Ctx<'de> {
    max_depth: usize,
    max_string_bytes: usize,
    error: RefCell<Option<RequestError>>,
    /// A float was seen that may be a rounded integer literal beyond 64 bits.
    maybe_big_integer: Cell<bool>,
    /// Elements and members of the containers being parsed, as one stack: each
    /// container moves its own tail into an exactly sized `Vec` when it closes.
    items: RefCell<Vec<Value<'de>>>,
    members: RefCell<Vec<(Cow<'de, str>, Value<'de>)>>,
}

impl Ctx<'_> {
    fn fail<E: de::Error>(&self, err: RequestError) -> E {
        self.error.borrow_mut().get_or_insert(err);
        E::custom("rejected")
    }
}

/// Parses a whole body. The result borrows escape-free strings from `body`.
pub fn parse_body<'de>(body: &'de [u8], limits: &Limits) -> Result<Value<'de>> {
    if body.len() > limits.max_body_bytes {
        return Err(RequestError::LimitExceeded {
            param: None,
            message: format!(
                "request body is {} bytes, over the limit of {} bytes",
                body.len(),
                limits.max_body_bytes
            ),
        });
    }
    let text = std::str::from_utf8(body).map_err(|e| RequestError::InvalidUtf8 {
        offset: e.valid_up_to(),
    })?;
    parse_str(text, limits)
}

/// Parses a JSON text (already known to be UTF-8).
pub fn parse_str<'de>(text: &'de str, limits: &Limits) -> Result<Value<'de>> {
    if text.trim_ascii().is_empty() {
        return Err(RequestError::InvalidJson {
            message: "request body is empty: expected a JSON object".into(),
        });
    }
    let ctx = Ctx {
        max_depth: limits.effective_depth(),
        max_string_bytes: limits.max_string_bytes,
        error: RefCell::new(None),
        maybe_big_integer: Cell::new(false),
        items: RefCell::new(Vec::with_capacity(64)),
        members: RefCell::new(Vec::with_capacity(64)),
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = ValueSeed {
        ctx: &ctx,
        depth: 0,
    }
    .deserialize(&mut de)
    .and_then(|v| de.end().map(|()| v));
    let mut value = parsed.map_err(|err| match ctx.error.take() {
        Some(typed) => typed,
        None => map_serde_error(text, &err),
    })?;
    if ctx.maybe_big_integer.get() {
        restore_big_integers(text, &mut value)?;
    }
    Ok(value)
}

/// Replaces every float that came from an integer literal (no `.`, `e` or `E`) with the
/// literal's exact digits. Number literals are met in the same order as the tree holds
/// the values, so one scan of the text pairs them up.
fn restore_big_integers<'de>(text: &'de str, value: &mut Value<'de>) -> Result<()> {
    let mut literals = NumberLiterals {
        text: text.as_bytes(),
        pos: 0,
    };
    restore_in(value, &mut literals, text)
}

fn restore_in<'de>(
    value: &mut Value<'de>,
    literals: &mut NumberLiterals<'_>,
    text: &'de str,
) -> Result<()> {
    match value {
        Value::Number(n) => {
            let Some((start, end)) = literals.next() else {
                return Ok(());
            };
            let literal = &text[start..end];
            if matches!(n, Number::Float(_)) && !literal.contains(['.', 'e', 'E']) {
                *value = Value::BigInt(Cow::Borrowed(literal));
            }
            Ok(())
        }
        Value::Array(items) => items
            .iter_mut()
            .try_for_each(|v| restore_in(v, literals, text)),
        Value::Object(members) => members
            .iter_mut()
            .try_for_each(|(_, v)| restore_in(v, literals, text)),
        _ => Ok(()),
    }
}

/// The byte ranges of number literals of a valid JSON text, in order (strings skipped).
struct NumberLiterals<'t> {
    text: &'t [u8],
    pos: usize,
}

impl Iterator for NumberLiterals<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        let t = self.text;
        while self.pos < t.len() {
            match t[self.pos] {
                b'"' => {
                    self.pos += 1;
                    while self.pos < t.len() && t[self.pos] != b'"' {
                        self.pos += if t[self.pos] == b'\\' { 2 } else { 1 };
                    }
                    self.pos += 1;
                }
                b'-' | b'0'..=b'9' => {
                    let start = self.pos;
                    while self.pos < t.len()
                        && matches!(t[self.pos], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                    {
                        self.pos += 1;
                    }
                    return Some((start, self.pos));
                }
                _ => self.pos += 1,
            }
        }
        None
    }
}

fn map_serde_error(text: &str, err: &serde_json::Error) -> RequestError {
    let msg = err.to_string();
    if msg.starts_with("recursion limit exceeded") {
        return depth_error(crate::limits::DEPTH_CEILING);
    }
    if err.is_eof() {
        return RequestError::InvalidJson {
            message: format!("invalid JSON: unexpected end of input (truncated body?): {msg}"),
        };
    }
    let offset = byte_offset(text, err.line(), err.column());
    let rest = text.get(offset.saturating_sub(1)..).unwrap_or("");
    let rest = rest.trim_start_matches([' ', '\t', '\r', '\n', ':', ',', '[']);
    let rest = rest.strip_prefix('-').unwrap_or(rest);
    if rest.starts_with("NaN") || rest.starts_with("Infinity") {
        return RequestError::InvalidJson {
            message: format!(
                "invalid JSON: NaN and Infinity are not JSON numbers (line {} column {})",
                err.line(),
                err.column()
            ),
        };
    }
    RequestError::InvalidJson {
        message: format!("invalid JSON: {msg}"),
    }
}

fn byte_offset(text: &str, line: usize, column: usize) -> usize {
    let line_start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    (line_start + column).min(text.len())
}

fn depth_error(max: usize) -> RequestError {
    RequestError::LimitExceeded {
        param: None,
        message: format!("request body nests deeper than the limit of {max} levels"),
    }
}

#[derive(Clone, Copy)]
struct ValueSeed<'c, 'de> {
    ctx: &'c Ctx<'de>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_, 'de> {
    type Value = Value<'de>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl ValueSeed<'_, '_> {
    fn check_string<E: de::Error>(&self, len: usize) -> Result<(), E> {
        if len > self.ctx.max_string_bytes {
            return Err(self.ctx.fail(RequestError::LimitExceeded {
                param: None,
                message: format!(
                    "a string of {len} bytes is over the limit of {} bytes",
                    self.ctx.max_string_bytes
                ),
            }));
        }
        Ok(())
    }

    fn nested<E: de::Error>(&self) -> Result<Self, E> {
        let depth = self.depth + 1;
        if depth > self.ctx.max_depth {
            return Err(self.ctx.fail(depth_error(self.ctx.max_depth)));
        }
        Ok(ValueSeed {
            ctx: self.ctx,
            depth,
        })
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_, 'de> {
    type Value = Value<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value<'de>, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value<'de>, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value<'de>, E> {
        Ok(Value::Number(Number::Int(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value<'de>, E> {
        Ok(Value::Number(match i64::try_from(v) {
            Ok(i) => Number::Int(i),
            Err(_) => Number::UInt(v),
        }))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value<'de>, E> {
        if v.is_finite() {
            if v.fract() == 0.0 && v.abs() >= 9.2e18 {
                self.ctx.maybe_big_integer.set(true);
            }
            Ok(Value::Number(Number::Float(v)))
        } else {
            Err(self.ctx.fail(RequestError::InvalidJson {
                message: "invalid JSON: number out of range".into(),
            }))
        }
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Value<'de>, E> {
        self.check_string(v.len())?;
        Ok(Value::String(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value<'de>, E> {
        self.check_string(v.len())?;
        Ok(Value::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value<'de>, E> {
        self.check_string(v.len())?;
        Ok(Value::String(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value<'de>, A::Error> {
        let inner = self.nested()?;
        let mark = self.ctx.items.borrow().len();
        while let Some(item) = seq.next_element_seed(inner)? {
            self.ctx.items.borrow_mut().push(item);
        }
        let items = self.ctx.items.borrow_mut().drain(mark..).collect();
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value<'de>, A::Error> {
        let key_seed = KeySeed { outer: self };
        let Some(first) = map.next_key_seed(key_seed)? else {
            self.nested::<A::Error>()?;
            return Ok(Value::Object(Vec::new()));
        };
        let inner = self.nested()?;
        let mark = self.ctx.members.borrow().len();
        let value = map.next_value_seed(inner)?;
        self.ctx.members.borrow_mut().push((first, value));
        while let Some(key) = map.next_key_seed(key_seed)? {
            let value = map.next_value_seed(inner)?;
            self.ctx.members.borrow_mut().push((key, value));
        }
        let members = self.ctx.members.borrow_mut().drain(mark..).collect();
        Ok(Value::Object(members))
    }
}

#[derive(Clone, Copy)]
struct KeySeed<'c, 'de> {
    outer: ValueSeed<'c, 'de>,
}

impl<'de> DeserializeSeed<'de> for KeySeed<'_, 'de> {
    type Value = Cow<'de, str>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_, 'de> {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        self.outer.check_string(v.len())?;
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Cow<'de, str>, E> {
        self.outer.check_string(v.len())?;
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Cow<'de, str>, E> {
        self.outer.check_string(v.len())?;
        Ok(Cow::Owned(v))
    }
}
