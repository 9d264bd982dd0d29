//! Bounds applied while parsing.

use serde::{Deserialize, Serialize};

/// Hard ceiling on nesting depth, whatever [`Limits::max_depth`] says. The JSON parser
/// (and every walk over a parsed value) recurses once per level; this bound keeps that
/// far from the stack limit of any thread, Python's included.
pub const DEPTH_CEILING: usize = 127;

/// Bounds applied while parsing one request. All sizes are in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Deepest nesting of arrays and objects (the body object is depth 1); values above
    /// [`DEPTH_CEILING`] act as the ceiling.
    pub max_depth: usize,
    /// Most messages in a chat or responses request.
    pub max_messages: usize,
    /// Most media items in a request.
    pub max_media_items: usize,
    /// Longest single string (keys included).
    pub max_string_bytes: usize,
    /// Most decoded media bytes in a request, all items together.
    pub max_media_bytes: usize,
    /// Most prompt token ids in a request, all prompts together.
    pub max_token_ids: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 64 * 1024 * 1024,
            max_depth: 64,
            max_messages: 1024,
            max_media_items: 64,
            max_string_bytes: 16 * 1024 * 1024,
            max_media_bytes: 32 * 1024 * 1024,
            max_token_ids: 1_048_576,
        }
    }
}

impl Limits {
    /// The depth actually enforced.
    pub fn effective_depth(&self) -> usize {
        self.max_depth.min(DEPTH_CEILING)
    }
}
