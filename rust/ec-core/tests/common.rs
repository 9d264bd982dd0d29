//! Shared helpers of the integration tests.
#![allow(dead_code)]

use ec_core::{parse_request, Endpoint, Limits, ParsedRequest, RequestError};

pub const PNG_B64: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

pub fn parse(endpoint: Endpoint, body: &str) -> Result<ParsedRequest, RequestError> {
    parse_request(endpoint, body.as_bytes(), "test-model", &Limits::default())
}

pub fn ok(endpoint: Endpoint, body: &str) -> ParsedRequest {
    parse(endpoint, body).unwrap_or_else(|e| panic!("{body}: unexpected error {e:?}"))
}

pub fn json(v: &ParsedRequest) -> serde_json::Value {
    serde_json::from_str(&v.to_json()).expect("to_json is JSON")
}

/// A chat body of one user message: a text part, then `part`; `extra` is appended to
/// the body's members (`,"cache_salt":"x"`).
pub fn chat_after_text(part: &str, extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what?"}},{part}]}}]{extra}}}"#
    )
}

/// A metadata-only reference part of `kind` (`image` or `video`) with `grid` (JSON).
pub fn embeds_part(kind: &str, uuid: &str, grid: &str) -> String {
    format!(
        r#"{{"type":"{kind}_embeds","{kind}_embeds":{{"{kind}_grid_thw":{grid}}},"uuid":"{uuid}"}}"#
    )
}
