//! The one error type of the core: every rejection names a code, a parameter path
//! (when a single field is at fault) and an OpenAI-style message.

use thiserror::Error;

/// A request that cannot be served as sent (an HTTP 400, or 413 for a body over the limit).
///
/// `param` is the offending parameter path (`messages[2].content[0].image_url.url`), or
/// `None` when the body as a whole is at fault.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    /// The body is not valid JSON (syntax, truncation, `NaN` / `Infinity` literals).
    #[error("{message}")]
    InvalidJson { message: String },
    /// The body is not valid UTF-8.
    #[error("request body is not valid UTF-8 (invalid byte at offset {offset})")]
    InvalidUtf8 { offset: usize },
    /// A value has the wrong JSON type.
    #[error("'{param}' must be {expected}, got {found}")]
    InvalidType {
        param: String,
        expected: &'static str,
        found: &'static str,
    },
    /// A required field is absent (or `null`).
    #[error("'{param}' is a required property")]
    MissingField { param: String },
    /// A value of the right type that is not allowed.
    #[error("{message}")]
    InvalidValue { param: String, message: String },
    /// A number outside its allowed range.
    #[error("{message}")]
    OutOfRange { param: String, message: String },
    /// A configured limit (depth, counts, sizes) was exceeded.
    #[error("{message}")]
    LimitExceeded {
        param: Option<String>,
        message: String,
    },
    /// A `data:` URL whose payload is not valid base64.
    #[error("{message}")]
    InvalidBase64 {
        param: Option<String>,
        message: String,
    },
    /// A malformed `data:` URL (no comma, not base64, wrong media type, empty).
    #[error("{message}")]
    InvalidDataUrl {
        param: Option<String>,
        message: String,
    },
    /// The endpoint name is none of chat, completions, responses, generate.
    #[error("unknown endpoint '{endpoint}': expected chat, completions, responses or generate")]
    UnknownEndpoint { endpoint: String },
}

impl RequestError {
    /// Short machine-readable reason (the `code` of the OpenAI error body).
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidJson { .. } => "invalid_json",
            Self::InvalidUtf8 { .. } => "invalid_utf8",
            Self::InvalidType { .. } => "invalid_type",
            Self::MissingField { .. } => "missing_field",
            Self::InvalidValue { .. } => "invalid_value",
            Self::OutOfRange { .. } => "out_of_range",
            Self::LimitExceeded { .. } => "limit_exceeded",
            Self::InvalidBase64 { .. } => "invalid_base64",
            Self::InvalidDataUrl { .. } => "invalid_data_url",
            Self::UnknownEndpoint { .. } => "unknown_endpoint",
        }
    }

    /// The parameter path, or `None` when the body as a whole is at fault.
    pub fn param(&self) -> Option<&str> {
        let p = match self {
            Self::InvalidType { param, .. }
            | Self::MissingField { param }
            | Self::InvalidValue { param, .. }
            | Self::OutOfRange { param, .. } => Some(param.as_str()),
            Self::LimitExceeded { param, .. }
            | Self::InvalidBase64 { param, .. }
            | Self::InvalidDataUrl { param, .. } => param.as_deref(),
            Self::InvalidJson { .. } | Self::InvalidUtf8 { .. } | Self::UnknownEndpoint { .. } => {
                None
            }
        };
        p.filter(|p| !p.is_empty())
    }

    /// The human-readable message.
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// The same error reported at another parameter path (used where a helper that
    /// knows no path, such as data-URL decoding, is called for a field).
    pub fn at(self, path: String) -> Self {
        match self {
            Self::LimitExceeded { message, .. } => Self::LimitExceeded {
                param: Some(path),
                message,
            },
            Self::InvalidBase64 { message, .. } => Self::InvalidBase64 {
                param: Some(path),
                message,
            },
            Self::InvalidDataUrl { message, .. } => Self::InvalidDataUrl {
                param: Some(path),
                message,
            },
            other => other,
        }
    }
}

/// Result alias of the core.
pub type Result<T, E = RequestError> = std::result::Result<T, E>;
