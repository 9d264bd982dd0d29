//! `ec_frontend._core`: thin PyO3 bindings over `ec-core`. Only type conversion, error
//! mapping and GIL handling live here; the stub `python/ec_frontend/_core.pyi` is the
//! Python-visible contract.

mod classes;
mod convert;
mod errors;
mod preprocess;

use ec_core::{Endpoint, Limits};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::classes::{PyLimits, PyMediaItem, PyParsedRequest};
use crate::convert::{opt_value_to_py, py_to_value};
use crate::errors::{to_py_err, RequestError};

/// The extension's own (Rust) allocations go to mimalloc: a request makes a few dozen
/// small ones (the JSON tree's containers, the owned `vllm_xargs` and transfer params,
/// message texts, media records), and mimalloc serves and frees those in a fraction of
/// the system allocator's time. Python objects still come from Python's allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Bodies at least this large are parsed with the GIL released. Below it, parsing takes
/// a few microseconds and handing the GIL back and forth would cost more (and could
/// park the request behind another thread's switch interval).
const DETACH_MIN_BODY_BYTES: usize = 32 * 1024;

fn body_bytes<'a>(py: Python<'_>, body: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    if let Ok(b) = body.cast::<PyBytes>() {
        return Ok(b.as_bytes());
    }
    if let Ok(s) = body.cast::<PyString>() {
        // A str holding lone surrogates has no UTF-8 form.
        return s
            .to_str()
            .map(str::as_bytes)
            .map_err(|_| to_py_err(py, &ec_core::RequestError::InvalidUtf8 { offset: 0 }));
    }
    Err(pyo3::exceptions::PyTypeError::new_err(
        "parse_request() body must be bytes or str",
    ))
}

/// Parse and validate a request body; raises `RequestError`.
#[pyfunction]
#[pyo3(signature = (endpoint, body, *, model_id = "", limits = None))]
fn parse_request(
    py: Python<'_>,
    endpoint: &str,
    body: &Bound<'_, PyAny>,
    model_id: &str,
    limits: Option<PyRef<'_, PyLimits>>,
) -> PyResult<PyParsedRequest> {
    let endpoint = Endpoint::from_name(endpoint).map_err(|e| to_py_err(py, &e))?;
    let limits = limits.map(|l| l.inner).unwrap_or_default();
    let bytes = body_bytes(py, body)?;
    let parse = || ec_core::parse_request(endpoint, bytes, model_id, &limits);
    let parsed = if bytes.len() >= DETACH_MIN_BODY_BYTES {
        py.detach(parse)
    } else {
        parse()
    };
    let mut inner = parsed.map_err(|e| to_py_err(py, &e))?;
    let media = std::mem::take(&mut inner.media)
        .into_iter()
        .map(|item| Py::new(py, PyMediaItem::from_core(item)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyParsedRequest { inner, media })
}

fn merge(
    py: Python<'_>,
    xargs: Option<&Bound<'_, PyAny>>,
    params: Option<&Bound<'_, PyAny>>,
    key: &'static str,
) -> PyResult<Py<PyAny>> {
    let depth = Limits::default().effective_depth();
    let to_value = |obj: Option<&Bound<'_, PyAny>>, name: &str| match obj.filter(|o| !o.is_none()) {
        None => Ok(None),
        Some(o) if o.is_instance_of::<PyDict>() => py_to_value(o, name, depth).map(Some),
        Some(o) => Err(ec_core::RequestError::InvalidType {
            param: name.to_owned(),
            expected: "a dict or None",
            found: if o.is_instance_of::<pyo3::types::PyList>() {
                "a list"
            } else {
                "another type"
            },
        }),
    };
    let xargs = to_value(xargs, "vllm_xargs").map_err(|e| to_py_err(py, &e))?;
    let params = to_value(params, key).map_err(|e| to_py_err(py, &e))?;
    let merged = ec_core::merge_transfer_params(xargs.as_ref(), params.as_ref(), key);
    Ok(opt_value_to_py(py, merged.as_ref())?.unbind())
}

/// `xargs` with `params` under `"kv_transfer_params"`; see the stub.
#[pyfunction]
#[pyo3(signature = (xargs, params))]
fn merge_kv_transfer_params(
    py: Python<'_>,
    xargs: Option<&Bound<'_, PyAny>>,
    params: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    merge(py, xargs, params, ec_core::merge::KV_KEY)
}

/// `xargs` with `params` under `"ec_transfer_params"`; see the stub.
#[pyfunction]
#[pyo3(signature = (xargs, params))]
fn merge_ec_transfer_params(
    py: Python<'_>,
    xargs: Option<&Bound<'_, PyAny>>,
    params: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    merge(py, xargs, params, ec_core::merge::EC_KEY)
}

fn kwargs_value(
    py: Python<'_>,
    processor_kwargs: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<ec_core::OwnedValue>> {
    processor_kwargs
        .filter(|o| !o.is_none())
        .map(|o| {
            py_to_value(o, "processor_kwargs", Limits::default().effective_depth())
                .map_err(|e| to_py_err(py, &e))
        })
        .transpose()
}

/// `image` or `video`.
fn media_kind(kind: &str) -> PyResult<ec_core::MediaKind> {
    match kind {
        "image" => Ok(ec_core::MediaKind::Image),
        "video" => Ok(ec_core::MediaKind::Video),
        _ => Err(pyo3::exceptions::PyValueError::new_err(
            "kind must be 'image' or 'video'",
        )),
    }
}

/// The content hash `parse_request` gives an inline item.
#[pyfunction]
#[pyo3(signature = (data, *, model_id = "", processor_kwargs = None, cache_salt = None, kind = "image", video_options = None))]
fn compute_mm_hash(
    py: Python<'_>,
    data: &[u8],
    model_id: &str,
    processor_kwargs: Option<&Bound<'_, PyAny>>,
    cache_salt: Option<&str>,
    kind: &str,
    video_options: Option<&Bound<'_, PyAny>>,
) -> PyResult<String> {
    let kind = media_kind(kind)?;
    let kwargs = kwargs_value(py, processor_kwargs)?;
    let video = kwargs_value(py, video_options)?;
    let hash = || {
        ec_core::KeyScope::new(model_id, kwargs.as_ref(), cache_salt)
            .with_video_options(video.as_ref())
            .content_hash_of(kind, data)
    };
    Ok(if data.len() >= DETACH_MIN_BODY_BYTES {
        py.detach(hash)
    } else {
        hash()
    })
}

/// The key `parse_request` gives an item that names itself by `uuid`.
#[pyfunction]
#[pyo3(signature = (uuid, *, model_id = "", processor_kwargs = None, cache_salt = None, kind = "image", video_options = None))]
fn hash_for_uuid(
    py: Python<'_>,
    uuid: &str,
    model_id: &str,
    processor_kwargs: Option<&Bound<'_, PyAny>>,
    cache_salt: Option<&str>,
    kind: &str,
    video_options: Option<&Bound<'_, PyAny>>,
) -> PyResult<String> {
    let kind = media_kind(kind)?;
    let kwargs = kwargs_value(py, processor_kwargs)?;
    let video = kwargs_value(py, video_options)?;
    Ok(
        ec_core::KeyScope::new(model_id, kwargs.as_ref(), cache_salt)
            .with_video_options(video.as_ref())
            .uuid_hash_of(kind, uuid),
    )
}

/// `(mime_type, bytes)` of a base64 `data:` URL.
#[pyfunction]
fn decode_data_url<'py>(py: Python<'py>, url: &str) -> PyResult<(String, Bound<'py, PyBytes>)> {
    let decode = || ec_core::decode_data_url(url);
    let decoded = if url.len() >= DETACH_MIN_BODY_BYTES {
        py.detach(decode)
    } else {
        decode()
    }
    .map_err(|e| to_py_err(py, &e))?;
    Ok((decoded.mime_type, PyBytes::new(py, &decoded.data)))
}

/// True for a non-empty lower-case hex string of at most 128 characters.
#[pyfunction]
fn is_valid_mm_hash(value: &str) -> bool {
    ec_core::is_valid_mm_hash(value)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let error_type = py.get_type::<RequestError>();
    // Class-level defaults; every raised instance sets its own values.
    error_type.setattr("param", py.None())?;
    error_type.setattr("message", "")?;
    error_type.setattr("code", "")?;
    m.add("RequestError", error_type)?;
    m.add_class::<PyLimits>()?;
    m.add_class::<PyMediaItem>()?;
    m.add_class::<PyParsedRequest>()?;
    m.add_function(wrap_pyfunction!(parse_request, m)?)?;
    m.add_function(wrap_pyfunction!(merge_kv_transfer_params, m)?)?;
    m.add_function(wrap_pyfunction!(merge_ec_transfer_params, m)?)?;
    m.add_function(wrap_pyfunction!(compute_mm_hash, m)?)?;
    m.add_function(wrap_pyfunction!(hash_for_uuid, m)?)?;
    m.add_function(wrap_pyfunction!(decode_data_url, m)?)?;
    m.add_function(wrap_pyfunction!(is_valid_mm_hash, m)?)?;
    preprocess::register(m)?;
    Ok(())
}
