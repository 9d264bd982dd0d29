//! A JSON value that borrows its strings from the request body where it can.
//!
//! Objects keep their members in order (duplicates included; readers take the last),
//! numbers keep full precision: integers outside 64 bits keep their digits.

use std::borrow::Cow;
use std::fmt::Write;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use crate::path::push_decimal;

/// A JSON number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// An integer in the signed 64-bit range (negative ones always land here).
    Int(i64),
    /// A non-negative integer above `i64::MAX`.
    UInt(u64),
    /// A finite floating-point number.
    Float(f64),
}

/// A JSON value; `'a` is the lifetime of the body it borrows from (`'static` when owned).
///
/// The word-sized tag puts every payload at an 8-byte boundary: a value moves as whole
/// aligned words (a byte tag lets the compiler copy the payload from offset 1 with
/// overlapping unaligned moves, which stall the loads that read it back).
#[derive(Debug, Clone, PartialEq)]
#[repr(u64)]
pub enum Value<'a> {
    Null,
    Bool(bool),
    Number(Number),
    /// An integer beyond 64 bits, as its decimal digits (with a leading `-` if negative).
    BigInt(Cow<'a, str>),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// An owned value.
pub type OwnedValue = Value<'static>;

impl<'a> Value<'a> {
    /// The JSON type name used in error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(Number::Float(_)) => "a number",
            Value::Number(_) | Value::BigInt(_) => "an integer",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }

    /// A copy that owns all its strings.
    pub fn into_owned(self) -> OwnedValue {
        match self {
            Value::Null => Value::Null,
            Value::Bool(b) => Value::Bool(b),
            Value::Number(n) => Value::Number(n),
            Value::BigInt(s) => Value::BigInt(Cow::Owned(s.into_owned())),
            Value::String(s) => Value::String(Cow::Owned(s.into_owned())),
            Value::Array(items) => Value::Array(items.into_iter().map(Value::into_owned).collect()),
            Value::Object(members) => Value::Object(
                members
                    .into_iter()
                    .map(|(k, v)| (Cow::Owned(k.into_owned()), v.into_owned()))
                    .collect(),
            ),
        }
    }

    /// An owned copy, made in one pass.
    pub fn to_owned_value(&self) -> OwnedValue {
        match self {
            Value::Null => Value::Null,
            Value::Bool(b) => Value::Bool(*b),
            Value::Number(n) => Value::Number(*n),
            Value::BigInt(s) => Value::BigInt(Cow::Owned(s.to_string())),
            Value::String(s) => Value::String(Cow::Owned(s.to_string())),
            Value::Array(items) => Value::Array(items.iter().map(Value::to_owned_value).collect()),
            Value::Object(members) => Value::Object(
                members
                    .iter()
                    .map(|(k, v)| (Cow::Owned(k.to_string()), v.to_owned_value()))
                    .collect(),
            ),
        }
    }

    /// The value of the last member named `key`, if this is an object that has one.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Nesting depth: 0 for a scalar, 1 for a flat array or object.
    pub fn depth(&self) -> usize {
        match self {
            Value::Array(items) => 1 + items.iter().map(Value::depth).max().unwrap_or(0),
            Value::Object(members) => 1 + members.iter().map(|(_, v)| v.depth()).max().unwrap_or(0),
            _ => 0,
        }
    }

    /// Canonical JSON: no whitespace, object keys sorted by their UTF-8 bytes with
    /// duplicates resolved to the last, integers in decimal, floats in Rust's shortest
    /// round-trip form. Equal data gives equal bytes on every instance.
    pub fn canonical_json(&self) -> String {
        let mut out = String::with_capacity(64);
        self.write_canonical(&mut out);
        out
    }

    fn write_canonical(&self, out: &mut String) {
        match self {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(Number::Int(i)) => {
                if *i < 0 {
                    out.push('-');
                }
                push_decimal(out, i.unsigned_abs());
            }
            Value::Number(Number::UInt(u)) => push_decimal(out, *u),
            Value::Number(Number::Float(f)) => {
                let _ = write!(out, "{f:?}");
            }
            Value::BigInt(digits) => out.push_str(digits),
            Value::String(s) => write_json_string(s, out),
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write_canonical(out);
                }
                out.push(']');
            }
            Value::Object(members) => {
                let mut sorted: Vec<&(Cow<'a, str>, Value<'a>)> = members.iter().collect();
                // Stable sort keeps duplicates in order, so the last one is kept below.
                sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.push('{');
                let mut first = true;
                for (i, (k, v)) in sorted.iter().map(|m| (&m.0, &m.1)).enumerate() {
                    if sorted.get(i + 1).is_some_and(|next| next.0 == *k) {
                        continue;
                    }
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    write_json_string(k, out);
                    out.push(':');
                    v.write_canonical(out);
                }
                out.push('}');
            }
        }
    }
}

fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

impl Serialize for Value<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Null => serializer.serialize_unit(),
            Value::Bool(b) => serializer.serialize_bool(*b),
            Value::Number(Number::Int(i)) => serializer.serialize_i64(*i),
            Value::Number(Number::UInt(u)) => serializer.serialize_u64(*u),
            Value::Number(Number::Float(f)) => serializer.serialize_f64(*f),
            Value::BigInt(digits) => {
                // A raw value keeps every digit (a serde_json Number would round it).
                let raw = serde_json::value::RawValue::from_string(digits.to_string())
                    .map_err(serde::ser::Error::custom)?;
                raw.serialize(serializer)
            }
            Value::String(s) => serializer.serialize_str(s),
            Value::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Value::Object(members) => {
                let mut map = serializer.serialize_map(Some(members.len()))?;
                for (k, v) in members {
                    map.serialize_entry(k.as_ref(), v)?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Number, Value};

    #[test]
    fn canonical_integers_match_their_decimal_form() {
        let ints = [0, 7, -7, 10, -10, 1234567890, i64::MAX, i64::MIN];
        for i in ints {
            let v = Value::Number(Number::Int(i));
            assert_eq!(v.canonical_json(), i.to_string());
        }
        for u in [i64::MAX as u64 + 1, u64::MAX] {
            let v = Value::Number(Number::UInt(u));
            assert_eq!(v.canonical_json(), u.to_string());
        }
    }
}
