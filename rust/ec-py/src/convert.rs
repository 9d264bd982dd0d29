//! JSON values <-> Python objects, written by hand: the hot path of every request.

use std::borrow::Cow;

use ec_core::{Number, OwnedValue, RequestError, Value};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// A Python object for a JSON value (`dict`, `list`, `str`, `int`, `float`, `bool`, `None`).
pub fn value_to_py<'py>(py: Python<'py>, v: &Value<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(Number::Int(i)) => i.into_pyobject(py)?.into_any(),
        Value::Number(Number::UInt(u)) => u.into_pyobject(py)?.into_any(),
        Value::Number(Number::Float(f)) => PyFloat::new(py, *f).into_any(),
        Value::BigInt(digits) => py.get_type::<PyInt>().call1((digits.as_ref(),))?,
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            // Built at its final size (appending grows the list step by step).
            let items = items
                .iter()
                .map(|item| value_to_py(py, item))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(members) => object_to_py(py, members)?.into_any(),
    })
}

/// A `dict` of an object's members (a later duplicate key wins).
pub fn object_to_py<'py>(
    py: Python<'py>,
    members: &[(Cow<'_, str>, Value<'_>)],
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (k, v) in members {
        dict.set_item(PyString::new(py, k), value_to_py(py, v)?)?;
    }
    Ok(dict)
}

/// An optional value as `None` or its Python object.
pub fn opt_value_to_py<'py>(py: Python<'py>, v: Option<&Value<'_>>) -> PyResult<Bound<'py, PyAny>> {
    match v {
        Some(v) => value_to_py(py, v),
        None => Ok(py.None().into_bound(py)),
    }
}

fn type_error(param: &str, expected: &'static str, found: &'static str) -> RequestError {
    RequestError::InvalidType {
        param: param.to_owned(),
        expected,
        found,
    }
}

fn py_type_name(obj: &Bound<'_, PyAny>) -> &'static str {
    if obj.is_instance_of::<PyDict>() {
        "an object"
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        "an array"
    } else if obj.is_instance_of::<PyString>() {
        "a string"
    } else {
        "a value that is not JSON"
    }
}

/// A JSON value for a Python object made of `dict` (with `str` keys), `list`, `tuple`,
/// `str`, `int`, `float` (finite), `bool` and `None`, nested at most `max_depth` deep.
/// `param` names the argument in errors.
pub fn py_to_value(
    obj: &Bound<'_, PyAny>,
    param: &str,
    max_depth: usize,
) -> Result<OwnedValue, RequestError> {
    py_to_value_at(obj, param, 0, max_depth)
}

fn py_to_value_at(
    obj: &Bound<'_, PyAny>,
    param: &str,
    depth: usize,
    max_depth: usize,
) -> Result<OwnedValue, RequestError> {
    let nested = || {
        if depth + 1 > max_depth {
            Err(RequestError::LimitExceeded {
                param: Some(param.to_owned()),
                message: format!("'{param}' nests deeper than the limit of {max_depth} levels"),
            })
        } else {
            Ok(depth + 1)
        }
    };
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast_exact::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        let s = s.to_str().map_err(|_| RequestError::InvalidValue {
            param: param.to_owned(),
            message: format!("'{param}' holds a string that is not valid Unicode"),
        })?;
        return Ok(Value::String(Cow::Owned(s.to_owned())));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        if let Ok(v) = i.extract::<i64>() {
            return Ok(Value::Number(Number::Int(v)));
        }
        if let Ok(v) = i.extract::<u64>() {
            return Ok(Value::Number(Number::UInt(v)));
        }
        let digits = i
            .str()
            .and_then(|s| s.to_str().map(str::to_owned))
            .map_err(|_| type_error(param, "a JSON value", "an integer that cannot be printed"))?;
        return Ok(Value::BigInt(Cow::Owned(digits)));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        let f = f.value();
        if !f.is_finite() {
            return Err(RequestError::InvalidValue {
                param: param.to_owned(),
                message: format!("'{param}' holds NaN or Infinity, which JSON cannot carry"),
            });
        }
        return Ok(Value::Number(Number::Float(f)));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let depth = nested()?;
        let mut members = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = k
                .cast::<PyString>()
                .map_err(|_| type_error(param, "an object with string keys", "another key type"))?
                .to_str()
                .map_err(|_| type_error(param, "an object with string keys", "an invalid key"))?
                .to_owned();
            let value = py_to_value_at(&v, param, depth, max_depth)?;
            members.push((Cow::Owned(key), value));
        }
        return Ok(Value::Object(members));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let depth = nested()?;
        let mut items = Vec::new();
        for item in obj
            .try_iter()
            .map_err(|_| type_error(param, "a JSON value", "an array"))?
        {
            let item = item.map_err(|_| type_error(param, "a JSON value", "an array"))?;
            items.push(py_to_value_at(&item, param, depth, max_depth)?);
        }
        return Ok(Value::Array(items));
    }
    Err(type_error(param, "a JSON value", py_type_name(obj)))
}
