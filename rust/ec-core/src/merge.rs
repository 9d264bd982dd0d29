//! `kv_transfer_params` / `ec_transfer_params` into `vllm_xargs` (DESIGN.md 4.1).

use std::borrow::Cow;

use crate::value::Value;

/// The `vllm_xargs` key of the KV transfer params.
pub const KV_KEY: &str = "kv_transfer_params";
/// The `vllm_xargs` key of the EC transfer params.
pub const EC_KEY: &str = "ec_transfer_params";

/// `xargs` with `params` stored under `key`.
///
/// * `params` present (even an empty object) is inserted and replaces any member of
///   `xargs` with the same name: the top-level request field wins.
/// * `params` absent leaves `xargs` as it is (including `None`).
/// * Inputs are borrowed and never changed; the result is a fresh map.
/// * The result is `None` only when there is nothing to carry (`xargs` and `params`
///   both absent).
///
/// A non-object `xargs` is the caller's error to report; it is replaced here by a
/// fresh object holding `params` only.
pub fn merge_transfer_params<'a>(
    xargs: Option<&Value<'a>>,
    params: Option<&Value<'a>>,
    key: &'static str,
) -> Option<Value<'a>> {
    let Some(params) = params else {
        return xargs.cloned();
    };
    let mut members: Vec<(Cow<'a, str>, Value<'a>)> = match xargs {
        Some(Value::Object(members)) => members.iter().filter(|(k, _)| k != key).cloned().collect(),
        _ => Vec::with_capacity(1),
    };
    members.push((Cow::Borrowed(key), params.clone()));
    Some(Value::Object(members))
}

/// [`merge_transfer_params`] for a caller that owns both values and gives them up:
/// the same result, without copying either.
pub fn merge_transfer_params_owned<'a>(
    xargs: Option<Value<'a>>,
    params: Option<Value<'a>>,
    key: &'static str,
) -> Option<Value<'a>> {
    let Some(params) = params else {
        return xargs;
    };
    let mut members = match xargs {
        Some(Value::Object(mut members)) => {
            members.retain(|(k, _)| k != key);
            members
        }
        _ => Vec::with_capacity(1),
    };
    members.push((Cow::Borrowed(key), params));
    Some(Value::Object(members))
}

/// [`merge_transfer_params`] under [`KV_KEY`].
pub fn merge_kv_transfer_params<'a>(
    xargs: Option<&Value<'a>>,
    params: Option<&Value<'a>>,
) -> Option<Value<'a>> {
    merge_transfer_params(xargs, params, KV_KEY)
}

/// [`merge_transfer_params`] under [`EC_KEY`].
pub fn merge_ec_transfer_params<'a>(
    xargs: Option<&Value<'a>>,
    params: Option<&Value<'a>>,
) -> Option<Value<'a>> {
    merge_transfer_params(xargs, params, EC_KEY)
}
