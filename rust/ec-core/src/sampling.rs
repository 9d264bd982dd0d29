//! Sampling fields -> [`SamplingParams`], with vLLM's defaults and the OpenAI ranges.

use std::collections::HashSet;

use crate::error::Result;
use crate::fields::{
    array, boolean, integer, integer_in, number, number_in, object, present, string,
    strip_digit_underscores, token_id, type_error, value_error,
};
use crate::fieldset::{Fields, F};
use crate::path::{Path, ROOT};
use crate::request::SamplingParams;
use crate::value::Value;

/// Largest `n` accepted (one request fans out into at most this many sequences).
pub const MAX_N: i64 = 128;
/// Below this temperature sampling is greedy (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_EPS: f64 = 1e-5;
/// Largest number of top logprobs per token.
pub const MAX_LOGPROBS: i64 = 20;

/// How an endpoint asks for logprobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobStyle {
    /// Chat: `logprobs: bool` plus `top_logprobs: int`.
    Chat,
    /// Completions and generate: `logprobs: int`.
    Count,
    /// Responses: `top_logprobs: int`, applied (as vLLM) only when `include` lists
    /// `message.output_text.logprobs` (the flag).
    Responses(bool),
}

/// Where the output length comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LengthFields {
    /// Fields in order of preference (`max_completion_tokens` before `max_tokens`).
    pub fields: &'static [F],
    /// Used when none is given.
    pub default: Option<u64>,
}

fn opt_f64(
    fields: &Fields<'_, '_>,
    f: F,
    at: &Path<'_>,
    lo: f64,
    hi: f64,
    lo_open: bool,
    default: f64,
) -> Result<f64> {
    match fields.get(f) {
        Some(v) => number_in(v, &at.key(f.name()), lo, hi, lo_open),
        None => Ok(default),
    }
}

fn opt_bool(fields: &Fields<'_, '_>, f: F, at: &Path<'_>, default: bool) -> Result<bool> {
    match fields.get(f) {
        Some(v) => boolean(v, &at.key(f.name())),
        None => Ok(default),
    }
}

/// Reads and validates the sampling fields of one object (`at` is its path).
pub fn sampling_params(
    fields: &Fields<'_, '_>,
    at: &Path<'_>,
    style: LogprobStyle,
    length: LengthFields,
    echo: bool,
    stream: bool,
) -> Result<SamplingParams> {
    let mut p = SamplingParams {
        max_tokens: length.default,
        ..SamplingParams::default()
    };
    // Every length field given must be an integer (vLLM's model checks each type);
    // the range applies to the one that wins.
    let mut winner = None;
    for &f in length.fields {
        if let Some(v) = fields.get(f) {
            let path = at.key(f.name());
            integer(v, &path)?;
            winner = winner.or(Some((v, path)));
        }
    }
    if let Some((v, path)) = winner {
        p.max_tokens = Some(integer_in(v, &path, 1, i64::MAX)? as u64);
    }
    p.temperature = opt_f64(fields, F::Temperature, at, 0.0, 2.0, false, 1.0)?;
    p.top_p = opt_f64(fields, F::TopP, at, 0.0, 1.0, true, 1.0)?;
    p.min_p = opt_f64(fields, F::MinP, at, 0.0, 1.0, false, 0.0)?;
    p.presence_penalty = opt_f64(fields, F::PresencePenalty, at, -2.0, 2.0, false, 0.0)?;
    p.frequency_penalty = opt_f64(fields, F::FrequencyPenalty, at, -2.0, 2.0, false, 0.0)?;
    p.repetition_penalty = opt_f64(
        fields,
        F::RepetitionPenalty,
        at,
        0.0,
        f64::INFINITY,
        true,
        1.0,
    )?;
    if let Some(v) = fields.get(F::TopK) {
        let k = integer_in(v, &at.key("top_k"), -1, i64::from(i32::MAX))?;
        p.top_k = k.max(0);
    }
    if let Some(v) = fields.get(F::Seed) {
        p.seed = Some(integer_in(v, &at.key("seed"), i64::MIN, i64::MAX)?);
    }
    if let Some(v) = fields.get(F::N) {
        p.n = integer_in(v, &at.key("n"), 1, MAX_N)? as u32;
    }
    if let Some(v) = fields.get(F::Stop) {
        p.stop = stop_list(v, &at.key("stop"))?;
    }
    if let Some(v) = fields.get(F::StopTokenIds) {
        p.stop_token_ids = token_ids(v, &at.key("stop_token_ids"))?;
    }
    if p.temperature < GREEDY_EPS {
        // Greedy decoding: vLLM's SamplingParams switches the truncations off.
        p.top_p = 1.0;
        p.top_k = 0;
        p.min_p = 0.0;
    }
    if let Some(v) = fields.get(F::MinTokens) {
        let path = at.key("min_tokens");
        let min = integer_in(v, &path, 0, i64::MAX)? as u64;
        if p.max_tokens.is_some_and(|max| min > max) {
            return Err(value_error(
                &path,
                format!(
                    "'min_tokens' must be less than or equal to 'max_tokens' ({}), got {min}",
                    p.max_tokens.unwrap_or_default()
                ),
            ));
        }
        p.min_tokens = min;
    }
    if let Some(v) = fields.get(F::LogitBias) {
        p.logit_bias = Some(logit_bias(v, &at.key("logit_bias"))?);
    }
    if let Some(v) = fields.get(F::AllowedTokenIds) {
        let path = at.key("allowed_token_ids");
        let ids = token_ids(v, &path)?;
        if ids.is_empty() {
            return Err(value_error(&path, "'allowed_token_ids' must not be empty"));
        }
        p.allowed_token_ids = Some(ids);
    }
    if let Some(v) = fields.get(F::BadWords) {
        p.bad_words = bad_words(v, &at.key("bad_words"))?;
    }
    p.ignore_eos = opt_bool(fields, F::IgnoreEos, at, false)?;
    p.skip_special_tokens = opt_bool(fields, F::SkipSpecialTokens, at, true)?;
    p.include_stop_str_in_output = opt_bool(fields, F::IncludeStopStrInOutput, at, false)?;

    let top_logprobs = match fields.get(F::TopLogprobs) {
        Some(v) => Some(integer_in(v, &at.key("top_logprobs"), 0, MAX_LOGPROBS)? as u32),
        None => None,
    };
    p.logprobs = match style {
        LogprobStyle::Chat => {
            let wanted = opt_bool(fields, F::Logprobs, at, false)?;
            if !wanted && top_logprobs.is_some_and(|k| k > 0) {
                return Err(value_error(
                    &at.key("top_logprobs"),
                    "when using 'top_logprobs', 'logprobs' must be set to true",
                ));
            }
            wanted.then_some(top_logprobs.unwrap_or(0))
        }
        LogprobStyle::Count => match fields.get(F::Logprobs) {
            Some(v) => Some(integer_in(v, &at.key("logprobs"), 0, MAX_LOGPROBS)? as u32),
            None => None,
        },
        LogprobStyle::Responses(included) => included.then(|| top_logprobs.unwrap_or(0)),
    };
    p.prompt_logprobs = match fields.get(F::PromptLogprobs) {
        Some(v) => {
            let path = at.key("prompt_logprobs");
            let k = integer_in(v, &path, -1, MAX_LOGPROBS)? as i32;
            if stream && k != 0 {
                return Err(value_error(
                    &path,
                    "'prompt_logprobs' are not available when 'stream' is true",
                ));
            }
            Some(k)
        }
        // As vLLM: an echoed completions prompt gets as many prompt logprobs as the
        // generated tokens (the parser refuses `echo` on chat).
        None if echo => p.logprobs.map(|k| k as i32),
        None => None,
    };
    Ok(p)
}

fn token_ids(v: &Value<'_>, path: &Path<'_>) -> Result<Vec<u32>> {
    array(v, path)?
        .iter()
        .enumerate()
        .map(|(i, t)| token_id(t, &path.index(i)))
        .collect()
}

/// Largest bias magnitude; vLLM clamps a bias to `[-100, 100]`.
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// `logit_bias`: an object from token id strings (as Python's `int()` reads them) to
/// numbers, each bias clamped as vLLM clamps it.
fn logit_bias(v: &Value<'_>, path: &Path<'_>) -> Result<Vec<(u32, f64)>> {
    object(v, path)?
        .iter()
        .map(|(key, bias)| {
            let at = path.key(key);
            let id = strip_digit_underscores(key)
                .and_then(|k| k.parse::<i64>().ok())
                .ok_or_else(|| {
                    value_error(
                        path,
                        format!("'{path}' has a key that is not an integer token id: {key:?}"),
                    )
                })?;
            if !(0..=i64::from(i32::MAX)).contains(&id) {
                return Err(value_error(
                    path,
                    format!("'{path}' has a token id outside the vocabulary: {id}"),
                ));
            }
            let bias = number(bias, &at)?;
            if bias.is_nan() {
                return Err(value_error(&at, format!("'{at}' must be a number")));
            }
            Ok((id as u32, bias.clamp(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
        })
        .collect()
}

/// `bad_words`: a list of non-empty strings, repeats dropped (vLLM keeps the first).
/// Repeats are found through a set, so the cost is linear in the list.
fn bad_words(v: &Value<'_>, path: &Path<'_>) -> Result<Vec<String>> {
    let items = array(v, path)?;
    let mut seen: HashSet<&str> = HashSet::with_capacity(items.len());
    let mut out: Vec<String> = Vec::new();
    for (i, w) in items.iter().enumerate() {
        let word = string(w, &path.index(i))?;
        if word.is_empty() {
            return Err(value_error(
                path,
                "bad_words cannot contain an empty string",
            ));
        }
        if seen.insert(word) {
            out.push(word.to_owned());
        }
    }
    Ok(out)
}

/// Most stop strings in a list (OpenAI's limit, which vLLM enforces too).
pub const MAX_STOP: usize = 4;

fn stop_list(v: &Value<'_>, path: &Path<'_>) -> Result<Vec<String>> {
    match v {
        Value::String(s) => Ok(vec![s.to_string()]),
        Value::Array(items) if items.len() > MAX_STOP => Err(value_error(
            path,
            format!(
                "'{path}' has {} stop strings, at most {MAX_STOP} are allowed",
                items.len()
            ),
        )),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, s)| string(s, &path.index(i)).map(str::to_owned))
            .collect(),
        other => Err(type_error(path, "a string or an array of strings", other)),
    }
}

/// `stream` and `stream_options.include_usage`; options without streaming are refused.
/// As vLLM, `continuous_usage_stats` counts only with `include_usage`.
pub fn stream_flags(fields: &Fields<'_, '_>) -> Result<(bool, bool, bool)> {
    let stream = opt_bool(fields, F::Stream, &Path::Root, false)?;
    let Some(options) = fields.get(F::StreamOptions) else {
        return Ok((stream, false, false));
    };
    let path = ROOT.key("stream_options");
    let members = object(options, &path)?;
    if !stream && !members.is_empty() {
        return Err(value_error(
            &path,
            "'stream_options' can only be set when 'stream' is true",
        ));
    }
    let flag = |name: &str| -> Result<bool> {
        present(options.get(name))
            .map(|v| boolean(v, &path.key(name)))
            .transpose()
            .map(|b| b.unwrap_or(false))
    };
    let include_usage = flag("include_usage")?;
    let continuous = flag("continuous_usage_stats")?;
    Ok((stream, include_usage, include_usage && continuous))
}
