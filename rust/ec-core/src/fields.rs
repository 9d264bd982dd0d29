//! Typed readers over [`Value`]: each names the parameter path when it rejects a value.
//! JSON `null` reads as absent everywhere (as an `Optional` field does in vLLM).

use std::borrow::Cow;

use crate::error::{RequestError, Result};
use crate::path::Path;
use crate::value::{Number, Value};

/// Members of an object.
pub type Members<'a> = [(Cow<'a, str>, Value<'a>)];

/// `Some(v)` unless `v` is absent or `null`.
pub fn present<'v, 'a>(v: Option<&'v Value<'a>>) -> Option<&'v Value<'a>> {
    v.filter(|v| !matches!(v, Value::Null))
}

/// A wrong-type error at `path`.
pub fn type_error(path: &Path<'_>, expected: &'static str, found: &Value<'_>) -> RequestError {
    RequestError::InvalidType {
        param: path.render(),
        expected,
        found: found.type_name(),
    }
}

/// An out-of-range error at `path`.
pub fn range_error(path: &Path<'_>, message: String) -> RequestError {
    RequestError::OutOfRange {
        param: path.render(),
        message,
    }
}

/// An invalid-value error at `path`.
pub fn value_error(path: &Path<'_>, message: impl Into<String>) -> RequestError {
    RequestError::InvalidValue {
        param: path.render(),
        message: message.into(),
    }
}

/// A missing-field error at `path`.
pub fn missing(path: &Path<'_>) -> RequestError {
    RequestError::MissingField {
        param: path.render(),
    }
}

/// The members of an object.
pub fn object<'v, 'a>(v: &'v Value<'a>, path: &Path<'_>) -> Result<&'v Members<'a>> {
    match v {
        Value::Object(members) => Ok(members),
        other => Err(type_error(path, "an object", other)),
    }
}

/// The items of an array.
pub fn array<'v, 'a>(v: &'v Value<'a>, path: &Path<'_>) -> Result<&'v [Value<'a>]> {
    match v {
        Value::Array(items) => Ok(items),
        other => Err(type_error(path, "an array", other)),
    }
}

/// A string.
pub fn string<'v>(v: &'v Value<'_>, path: &Path<'_>) -> Result<&'v str> {
    match v {
        Value::String(s) => Ok(s),
        other => Err(type_error(path, "a string", other)),
    }
}

/// A boolean, coerced as pydantic's lax mode does for vLLM: `0`/`1` (integer or
/// float) and the strings `true false 1 0 yes no on off t f y n` in any case.
pub fn boolean(v: &Value<'_>, path: &Path<'_>) -> Result<bool> {
    let found = match v {
        Value::Bool(b) => return Ok(*b),
        Value::Number(Number::Int(i)) if matches!(i, 0 | 1) => return Ok(*i == 1),
        Value::Number(Number::UInt(u)) if matches!(u, 0 | 1) => return Ok(*u == 1),
        Value::Number(Number::Float(f)) if *f == 0.0 || *f == 1.0 => return Ok(*f == 1.0),
        Value::String(s) => match lax_bool(s) {
            Some(b) => return Ok(b),
            None => "a string that is not a boolean",
        },
        Value::Number(_) => "a number other than 0 or 1",
        other => other.type_name(),
    };
    Err(RequestError::InvalidType {
        param: path.render(),
        expected: "a boolean",
        found,
    })
}

fn lax_bool(s: &str) -> Option<bool> {
    const TRUE: [&str; 6] = ["true", "1", "yes", "on", "t", "y"];
    const FALSE: [&str; 6] = ["false", "0", "no", "off", "f", "n"];
    if TRUE.iter().any(|t| t.eq_ignore_ascii_case(s)) {
        Some(true)
    } else if FALSE.iter().any(|t| t.eq_ignore_ascii_case(s)) {
        Some(false)
    } else {
        None
    }
}

/// `s` without its surrounding whitespace and with the underscores that stand between
/// two digits removed; `None` when an underscore stands anywhere else (as Python's
/// number syntax, which pydantic follows).
pub(crate) fn strip_digit_underscores(s: &str) -> Option<Cow<'_, str>> {
    let s = s.trim();
    if !s.contains('_') {
        return Some(Cow::Borrowed(s));
    }
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let mut out = String::with_capacity(s.len());
    for (i, c) in s.char_indices() {
        if c == '_' {
            if i == 0 || !digit(i - 1) || !digit(i + 1) {
                return None;
            }
        } else {
            out.push(c);
        }
    }
    Some(Cow::Owned(out))
}

/// A numeric string as pydantic reads one for a `float` field.
fn lax_float(s: &str) -> Option<f64> {
    let s = strip_digit_underscores(s)?;
    let body = s.trim_start_matches(['+', '-']);
    let named = ["inf", "infinity", "nan"]
        .iter()
        .any(|n| n.eq_ignore_ascii_case(body));
    let plain = !body.is_empty()
        && body
            .bytes()
            .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-'));
    if named || plain {
        s.parse().ok()
    } else {
        None
    }
}

/// A string read as pydantic reads one for an `int` field: an optional sign, digits
/// and an optional fraction of zeros (`"16"`, `" 16 "`, `"16.0"`; not `"16.5"`).
/// `Err(true)` when it is an integer outside the 64-bit range.
fn lax_int(s: &str) -> std::result::Result<i64, bool> {
    let s = strip_digit_underscores(s).ok_or(false)?;
    let (int, frac) = s.split_once('.').unwrap_or((&s, ""));
    let digits = int.strip_prefix(['+', '-']).unwrap_or(int);
    let fraction_ok = !s.contains('.') || (!frac.is_empty() && frac.bytes().all(|c| c == b'0'));
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) || !fraction_ok {
        return Err(false);
    }
    int.parse().map_err(|_| true)
}

/// A number; a numeric string or a boolean is coerced as pydantic's lax mode does.
pub fn number(v: &Value<'_>, path: &Path<'_>) -> Result<f64> {
    match v {
        Value::Number(Number::Int(i)) => Ok(*i as f64),
        Value::Number(Number::UInt(u)) => Ok(*u as f64),
        Value::Number(Number::Float(f)) => Ok(*f),
        Value::Bool(b) => Ok(f64::from(u8::from(*b))),
        Value::String(s) => lax_float(s).ok_or(RequestError::InvalidType {
            param: path.render(),
            expected: "a number",
            found: "a string that is not a number",
        }),
        Value::BigInt(_) => Err(range_error(path, format!("'{path}' is too large"))),
        other => Err(type_error(path, "a number", other)),
    }
}

/// An integer in the signed 64-bit range, coerced as pydantic's lax mode does for
/// vLLM: a float with no fractional part, a boolean (`0`/`1`) and an integer string
/// are accepted; `1.5` and `"16.5"` are not.
pub fn integer(v: &Value<'_>, path: &Path<'_>) -> Result<i64> {
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    match v {
        Value::Number(Number::Int(i)) => Ok(*i),
        Value::Number(Number::UInt(_)) | Value::BigInt(_) => Err(range_error(
            path,
            format!("'{path}' is outside the 64-bit integer range"),
        )),
        Value::Number(Number::Float(f)) if f.fract() == 0.0 => {
            if (-LIMIT..LIMIT).contains(f) {
                Ok(*f as i64)
            } else {
                Err(range_error(
                    path,
                    format!("'{path}' is outside the 64-bit integer range"),
                ))
            }
        }
        Value::Number(Number::Float(_)) => Err(RequestError::InvalidType {
            param: path.render(),
            expected: "an integer",
            found: "a number with a fractional part",
        }),
        Value::Bool(b) => Ok(i64::from(*b)),
        Value::String(s) => lax_int(s).map_err(|too_large| {
            if too_large {
                range_error(
                    path,
                    format!("'{path}' is outside the 64-bit integer range"),
                )
            } else {
                RequestError::InvalidType {
                    param: path.render(),
                    expected: "an integer",
                    found: "a string that is not an integer",
                }
            }
        }),
        other => Err(type_error(path, "an integer", other)),
    }
}

/// An integer within `[lo, hi]`.
pub fn integer_in(v: &Value<'_>, path: &Path<'_>, lo: i64, hi: i64) -> Result<i64> {
    let i = integer(v, path)?;
    if i < lo || i > hi {
        let bound = if hi == i64::MAX {
            format!("at least {lo}")
        } else {
            format!("between {lo} and {hi}")
        };
        return Err(range_error(
            path,
            format!("'{path}' must be {bound}, got {i}"),
        ));
    }
    Ok(i)
}

/// A number within `[lo, hi]`; `lo_open` excludes `lo` itself.
pub fn number_in(v: &Value<'_>, path: &Path<'_>, lo: f64, hi: f64, lo_open: bool) -> Result<f64> {
    let f = number(v, path)?;
    let low_ok = if lo_open { f > lo } else { f >= lo };
    if !low_ok || f > hi {
        let (open, close) = (if lo_open { "(" } else { "[" }, "]");
        let bound = if hi.is_infinite() {
            format!("greater than {lo}")
        } else {
            format!("in {open}{lo}, {hi}{close}")
        };
        return Err(range_error(
            path,
            format!("'{path}' must be {bound}, got {f}"),
        ));
    }
    Ok(f)
}

/// An optional string (absent or `null` -> `None`).
pub fn opt_string(v: Option<&Value<'_>>, path: &Path<'_>) -> Result<Option<String>> {
    present(v)
        .map(|v| string(v, path).map(str::to_owned))
        .transpose()
}

/// An optional boolean with a default.
pub fn opt_bool(v: Option<&Value<'_>>, path: &Path<'_>, default: bool) -> Result<bool> {
    present(v).map_or(Ok(default), |v| boolean(v, path))
}

/// An optional object, kept as an owned value.
pub fn opt_object(v: Option<&Value<'_>>, path: &Path<'_>) -> Result<Option<Value<'static>>> {
    match present(v) {
        None => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v.to_owned_value())),
        Some(other) => Err(type_error(path, "an object", other)),
    }
}

/// Whether an optional object is there: absent or `null` -> `false`, an object ->
/// `true`, anything else -> a type error.
pub fn check_object(v: Option<&Value<'_>>, path: &Path<'_>) -> Result<bool> {
    match present(v) {
        None => Ok(false),
        Some(Value::Object(_)) => Ok(true),
        Some(other) => Err(type_error(path, "an object", other)),
    }
}

/// A token id: an integer in `[0, 2^31)`.
pub fn token_id(v: &Value<'_>, path: &Path<'_>) -> Result<u32> {
    integer_in(v, path, 0, i64::from(i32::MAX)).map(|i| i as u32)
}
