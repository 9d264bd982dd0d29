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

/// A boolean.
pub fn boolean(v: &Value<'_>, path: &Path<'_>) -> Result<bool> {
    match v {
        Value::Bool(b) => Ok(*b),
        other => Err(type_error(path, "a boolean", other)),
    }
}

/// A finite number.
pub fn number(v: &Value<'_>, path: &Path<'_>) -> Result<f64> {
    match v {
        Value::Number(Number::Int(i)) => Ok(*i as f64),
        Value::Number(Number::UInt(u)) => Ok(*u as f64),
        Value::Number(Number::Float(f)) => Ok(*f),
        Value::BigInt(_) => Err(range_error(path, format!("'{path}' is too large"))),
        other => Err(type_error(path, "a number", other)),
    }
}

/// An integer in the signed 64-bit range. A float with no fractional part is accepted
/// (as pydantic's lax mode does for vLLM); `1.5` is not.
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
