//! Inline media: `data:` URL decoding, and the keys (`mm_hash`) of media items
//! (DESIGN.md 4.5).
//!
//! A key is blake3 over length-framed fields: a domain tag naming the kind of key
//! (content, URL, uuid), the model id, the canonical JSON of the processor kwargs,
//! the tenant's `cache_salt` (with a presence flag) and the item itself (its bytes,
//! its URL or the uuid). Framing makes the byte stream decodable, and the kinds have
//! different tags, so two keys are equal only when every field is: a uuid can never
//! give the key of some content, and two salts never share a key.

use std::cell::OnceCell;

use crate::error::{RequestError, Result};
use crate::value::Value;

/// Domain tag of a content hash; bump the version whenever the hashed fields change.
const CONTENT_TAG: &[u8] = b"ec-frontend/mm_hash/content/v2";
/// Domain tag of the hash of a URL reference.
const URL_TAG: &[u8] = b"ec-frontend/mm_hash/url/v2";
/// Domain tag of the hash of a user-supplied uuid.
const UUID_TAG: &[u8] = b"ec-frontend/mm_hash/uuid/v2";
/// Domain tags of the three kinds of video key: a video's key also covers its
/// sampling options (`media_io_kwargs.video`), so each kind has a tag of its own.
const VIDEO_CONTENT_TAG: &[u8] = b"ec-frontend/mm_hash/video-content/v1";
const VIDEO_URL_TAG: &[u8] = b"ec-frontend/mm_hash/video-url/v1";
const VIDEO_UUID_TAG: &[u8] = b"ec-frontend/mm_hash/video-uuid/v1";

/// Longest accepted hash.
pub const MAX_HASH_LEN: usize = 128;

/// Longest accepted uuid, in bytes.
pub const MAX_UUID_LEN: usize = 4 * MAX_HASH_LEN;

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

/// Which media an item is: a video's key also covers its sampling options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Video,
}

impl MediaKind {
    /// `image` or `video`.
    pub fn as_str(self) -> &'static str {
        match self {
            MediaKind::Image => "image",
            MediaKind::Video => "video",
        }
    }
}

/// Everything besides the item itself that enters its key: the model, the processor
/// kwargs and the tenant's `cache_salt`, and for a video its sampling options. Every
/// instance of a deployment builds the same scope from the same request, so encoder
/// and prefill/decode agree on keys.
pub struct KeyScope<'s> {
    model_id: &'s str,
    /// Canonical JSON of the processor kwargs (`""` when none).
    kwargs: String,
    cache_salt: Option<&'s str>,
    /// Canonical JSON of `media_io_kwargs.video` (`""` when none): how a video's frames
    /// are sampled, which changes its encoder output.
    video: String,
    /// Hashers primed with everything but the item, one per kind of key (image
    /// content, URL, uuid, then the same for videos); made on first use.
    primed: [OnceCell<blake3::Hasher>; 6],
}

impl<'s> KeyScope<'s> {
    /// The scope of one request: `cache_salt` as the request gave it (the parser
    /// rejects an empty one; here `Some("")` still differs from `None`).
    pub fn new(
        model_id: &'s str,
        processor_kwargs: Option<&Value<'_>>,
        cache_salt: Option<&'s str>,
    ) -> Self {
        Self {
            model_id,
            kwargs: processor_kwargs
                .map(Value::canonical_json)
                .unwrap_or_default(),
            cache_salt,
            video: String::new(),
            primed: Default::default(),
        }
    }

    /// The scope with a video's sampling options (vLLM's `media_io_kwargs.video`):
    /// they enter every video key, never an image key.
    pub fn with_video_options(mut self, options: Option<&Value<'_>>) -> Self {
        self.video = options.map(Value::canonical_json).unwrap_or_default();
        self
    }

    fn key(&self, slot: usize, item: &[u8]) -> String {
        const TAGS: [&[u8]; 6] = [
            CONTENT_TAG,
            URL_TAG,
            UUID_TAG,
            VIDEO_CONTENT_TAG,
            VIDEO_URL_TAG,
            VIDEO_UUID_TAG,
        ];
        let primed = self.primed[slot].get_or_init(|| {
            let mut hasher = blake3::Hasher::new();
            update_framed(&mut hasher, TAGS[slot]);
            update_framed(&mut hasher, self.model_id.as_bytes());
            update_framed(&mut hasher, self.kwargs.as_bytes());
            update_framed(&mut hasher, &[u8::from(self.cache_salt.is_some())]);
            update_framed(&mut hasher, self.cache_salt.unwrap_or("").as_bytes());
            if slot >= 3 {
                update_framed(&mut hasher, self.video.as_bytes());
            }
            hasher
        });
        let mut hasher = primed.clone();
        update_framed(&mut hasher, item);
        hasher.finalize().to_hex().to_string()
    }

    fn slot(kind: MediaKind, base: usize) -> usize {
        match kind {
            MediaKind::Image => base,
            MediaKind::Video => base + 3,
        }
    }

    /// The key of an inline image: its decoded bytes under the content tag.
    pub fn content_hash(&self, data: &[u8]) -> String {
        self.key(0, data)
    }

    /// The key of an inline item of `kind`: its decoded bytes (and for a video, the
    /// scope's sampling options) under the kind's content tag.
    pub fn content_hash_of(&self, kind: MediaKind, data: &[u8]) -> String {
        self.key(Self::slot(kind, 0), data)
    }

    /// The key of an image referenced by URL (its content is not in the request): the
    /// URL in place of the bytes, under its own tag.
    pub fn url_hash(&self, url: &str) -> String {
        self.key(1, url.as_bytes())
    }

    /// As [`KeyScope::url_hash`], for an item of `kind`.
    pub fn url_hash_of(&self, kind: MediaKind, url: &str) -> String {
        self.key(Self::slot(kind, 1), url.as_bytes())
    }

    /// The key of an image named by a user-supplied `uuid`: always hashed under the uuid
    /// tag, whatever the uuid looks like (a uuid that is itself lower-case hex is not
    /// used as the key: it could be another item's content hash).
    pub fn uuid_hash(&self, uuid: &str) -> String {
        self.key(2, uuid.as_bytes())
    }

    /// As [`KeyScope::uuid_hash`], for an item of `kind`: a video named by its uuid
    /// still gets one key per way of sampling it.
    pub fn uuid_hash_of(&self, kind: MediaKind, uuid: &str) -> String {
        self.key(Self::slot(kind, 2), uuid.as_bytes())
    }
}

/// The content hash of an inline item without a `cache_salt`
/// (`KeyScope::new(model_id, processor_kwargs, None).content_hash(data)`). Lower-case hex.
pub fn compute_mm_hash(
    data: &[u8],
    model_id: &str,
    processor_kwargs: Option<&Value<'_>>,
) -> String {
    KeyScope::new(model_id, processor_kwargs, None).content_hash(data)
}

/// True for a non-empty lower-case hex string of at most [`MAX_HASH_LEN`] characters.
pub fn is_valid_mm_hash(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= MAX_HASH_LEN
        && value
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
