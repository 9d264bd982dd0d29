//! `ec_core::RequestError` -> `ec_frontend._core.RequestError` (a `ValueError`).

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    ec_frontend._core,
    RequestError,
    PyValueError,
    "A request that cannot be served as sent; `.param`, `.message` and `.code` say why."
);

/// The Python exception for a core error, with `param`, `message` and `code` set.
pub fn to_py_err(py: Python<'_>, err: &ec_core::RequestError) -> PyErr {
    let message = err.message();
    let py_err = RequestError::new_err(message.clone());
    let value = py_err.value(py);
    let set = || -> PyResult<()> {
        value.setattr("param", err.param())?;
        value.setattr("message", message)?;
        value.setattr("code", err.code())?;
        Ok(())
    };
    match set() {
        Ok(()) => py_err,
        Err(e) => e,
    }
}
