//! Inline media: `data:` URL decoding and content hashes (DESIGN.md 4.5).

use crate::error::{RequestError, Result};
use crate::value::Value;

/// Domain tag of a content hash; bump the version if the hashed fields ever change.
pub(crate) const CONTENT_TAG: &[u8] = b"ec-frontend/mm_hash/content/v1";
/// Domain tag of the hash of a URL reference.
pub(crate) const URL_TAG: &[u8] = b"ec-frontend/mm_hash/url/v1";
/// Domain tag of the hash of a user-supplied uuid that is not already lower-case hex.
const UUID_TAG: &[u8] = b"ec-frontend/mm_hash/uuid/v1";

/// Longest accepted hash (and longest uuid used as-is).
pub const MAX_HASH_LEN: usize = 128;

/// A decoded `data:` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataUrl {
    /// The media type (`image/png`); `text/plain` when the URL names none, as RFC 2397 says.
    pub mime_type: String,
    /// The decoded payload.
    pub data: Vec<u8>,
}

fn bad_url(message: impl Into<String>) -> RequestError {
    RequestError::InvalidDataUrl {
        param: None,
        message: message.into(),
    }
}

/// Splits a base64 `data:` URL into its media type and payload, without decoding.
pub fn split_data_url(url: &str) -> Result<(&str, &str)> {
    let rest = url
        .get(..5)
        .filter(|scheme| scheme.eq_ignore_ascii_case("data:"))
        .map(|_| &url[5..])
        .ok_or_else(|| bad_url("not a data: URL"))?;
    let (header, payload) = rest
        .split_once(',')
        .ok_or_else(|| bad_url("data: URL has no ',' before its payload"))?;
    let mut fields = header.split(';');
    let mime = fields.next().unwrap_or("").trim();
    if !fields.any(|f| f.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad_url(
            "only base64 data: URLs are supported (';base64' missing)",
        ));
    }
    let mime = if mime.is_empty() { "text/plain" } else { mime };
    Ok((mime, payload))
}

/// Upper bound of the decoded size of a base64 payload.
pub fn decoded_len_bound(payload: &str) -> usize {
    payload.len() / 4 * 3 + 3
}

/// Decodes a base64 payload (padding optional, ASCII whitespace ignored).
pub fn decode_base64(payload: &str) -> Result<Vec<u8>> {
    base64_simd::forgiving_decode_to_vec(payload.as_bytes()).map_err(|_| {
        RequestError::InvalidBase64 {
            param: None,
            message: "data: URL payload is not valid base64".into(),
        }
    })
}

/// `(mime_type, bytes)` of a base64 `data:` URL; an empty payload is an error.
pub fn decode_data_url(url: &str) -> Result<DataUrl> {
    let (mime, payload) = split_data_url(url)?;
    let data = decode_base64(payload)?;
    if data.is_empty() {
        return Err(bad_url("data: URL payload is empty"));
    }
    Ok(DataUrl {
        mime_type: mime.to_ascii_lowercase(),
        data,
    })
}

fn update_framed(hasher: &mut blake3::Hasher, field: &[u8]) {
    hasher.update(&(field.len() as u64).to_le_bytes());
    hasher.update(field);
}

/// A hasher primed with a domain tag, the model id and the canonical processor kwargs.
pub(crate) fn prefix_hasher(tag: &[u8], model_id: &str, canonical_kwargs: &str) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new();
    update_framed(&mut hasher, tag);
    update_framed(&mut hasher, model_id.as_bytes());
    update_framed(&mut hasher, canonical_kwargs.as_bytes());
    hasher
}

/// Adds the item's own bytes to a primed hasher; lower-case hex.
pub(crate) fn finish_hash(mut hasher: blake3::Hasher, data: &[u8]) -> String {
    update_framed(&mut hasher, data);
    hasher.finalize().to_hex().to_string()
}

/// The content hash of a media item: blake3 over a domain tag, the model id, the
/// canonical JSON of the processor kwargs (`""` when none) and the decoded bytes, each
/// length-framed so that no two different inputs share a byte stream. Lower-case hex.
pub fn compute_mm_hash(
    data: &[u8],
    model_id: &str,
    processor_kwargs: Option<&Value<'_>>,
) -> String {
    let kwargs = processor_kwargs
        .map(Value::canonical_json)
        .unwrap_or_default();
    finish_hash(prefix_hasher(CONTENT_TAG, model_id, &kwargs), data)
}

/// The hash of an item referenced by URL (its content is not in the request): the URL
/// enters in place of the bytes, with its own domain tag.
pub fn compute_url_hash(url: &str, model_id: &str, processor_kwargs: Option<&Value<'_>>) -> String {
    let kwargs = processor_kwargs
        .map(Value::canonical_json)
        .unwrap_or_default();
    finish_hash(prefix_hasher(URL_TAG, model_id, &kwargs), url.as_bytes())
}

/// The `mm_hash` that a user-supplied uuid gives an item: the uuid itself when it is
/// already a valid hash, else its blake3 hash (so one uuid names one item everywhere).
pub fn hash_for_uuid(uuid: &str) -> String {
    if is_valid_mm_hash(uuid) {
        return uuid.to_owned();
    }
    let mut hasher = blake3::Hasher::new();
    update_framed(&mut hasher, UUID_TAG);
    update_framed(&mut hasher, uuid.as_bytes());
    hasher.finalize().to_hex().to_string()
}

/// True for a non-empty lower-case hex string of at most [`MAX_HASH_LEN`] characters.
pub fn is_valid_mm_hash(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= MAX_HASH_LEN
        && value
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
