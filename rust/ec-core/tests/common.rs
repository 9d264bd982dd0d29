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
