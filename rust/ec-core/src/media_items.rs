//! Collecting a request's media items: decoding inline data, hashing, limits.

use crate::content::EmbedsMeta;
use crate::error::{RequestError, Result};
use crate::fields::value_error;
use crate::limits::Limits;
use crate::media::{
    decode_base64, decoded_len_bound, split_data_url, KeyScope, MediaKind, MAX_UUID_LEN,
};
use crate::path::Path;
use crate::request::MediaItem;
use crate::value::Value;

/// Accumulates the media items of one request in order of appearance.
pub struct MediaCollector<'l> {
    limits: &'l Limits,
    /// What enters every key of this request besides the item.
    scope: KeyScope<'l>,
    total_bytes: usize,
    pub items: Vec<MediaItem>,
}

impl<'l> MediaCollector<'l> {
    /// `model_id`, the processor kwargs and `cache_salt` enter every key of this request;
    /// `video_options` (`media_io_kwargs.video`) every video key.
    pub fn new(
        limits: &'l Limits,
        model_id: &'l str,
        processor_kwargs: Option<&Value<'_>>,
        cache_salt: Option<&'l str>,
        video_options: Option<&Value<'_>>,
    ) -> Self {
        Self {
            limits,
            scope: KeyScope::new(model_id, processor_kwargs, cache_salt)
                .with_video_options(video_options),
            total_bytes: 0,
            items: Vec::new(),
        }
    }

    /// Adds one image or video given by `url` (a base64 `data:` URL whose media type is
    /// `image/*` or `video/*` as `kind` says, an http(s) URL or a `file://` URL) found at
    /// `url_path`; `item_path` is what [`MediaItem::param`] reports. Returns its index.
    pub fn add_url_item(
        &mut self,
        kind: MediaKind,
        url: &str,
        uuid: Option<&str>,
        item_path: &Path<'_>,
        url_path: &Path<'_>,
        uuid_path: &Path<'_>,
    ) -> Result<usize> {
        self.check_room(item_path)?;
        if let Some(uuid) = uuid {
            check_uuid(uuid, uuid_path)?;
        }
        let is_data = url
            .get(..5)
            .is_some_and(|s| s.eq_ignore_ascii_case("data:"));
        let item = if is_data {
            let (mime, payload) = split_data_url(url).map_err(|e| e.at(url_path.render()))?;
            let mime = mime.to_ascii_lowercase();
            let family = kind.as_str();
            if mime
                .strip_prefix(family)
                .and_then(|r| r.strip_prefix('/'))
                .is_none()
            {
                return Err(RequestError::InvalidDataUrl {
                    param: Some(url_path.render()),
                    message: format!(
                        "data: URL media type must be {family}/*, got '{}'",
                        crate::content::clip(&mime)
                    ),
                });
            }
            let room = self.limits.max_media_bytes.saturating_sub(self.total_bytes);
            let over = |size: usize| RequestError::LimitExceeded {
                param: Some(url_path.render()),
                message: format!(
                    "media of {size} bytes is over the request's limit of {} bytes",
                    self.limits.max_media_bytes
                ),
            };
            if decoded_len_bound(payload) > room + 3 {
                return Err(over(decoded_len_bound(payload)));
            }
            let data = decode_base64(payload).map_err(|e| e.at(url_path.render()))?;
            if data.is_empty() {
                return Err(RequestError::InvalidDataUrl {
                    param: Some(url_path.render()),
                    message: "data: URL payload is empty".into(),
                });
            }
            if data.len() > room {
                return Err(over(data.len()));
            }
            self.total_bytes += data.len();
            let mm_hash = match uuid {
                Some(u) => self.scope.uuid_hash_of(kind, u),
                None => self.scope.content_hash_of(kind, &data),
            };
            MediaItem {
                kind: kind.as_str(),
                mime_type: Some(mime),
                data: Some(data),
                url: None,
                uuid: uuid.map(str::to_owned),
                mm_hash,
                param: item_path.render(),
                grid_thw: None,
                second_per_grid_ts: None,
                timestamps: None,
            }
        } else {
            // A URL reference: the server fetches http(s) URLs, and reads file:// URLs
            // below its allowed local media path; that policy lives with the fetcher.
            let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
            if !(lower.starts_with("http://")
                || lower.starts_with("https://")
                || lower.starts_with("file://"))
            {
                return Err(value_error(
                    url_path,
                    format!(
                        "{} URL must be an http(s) URL, a file:// URL or a base64 data: URL",
                        kind.as_str()
                    ),
                ));
            }
            let mm_hash = match uuid {
                Some(u) => self.scope.uuid_hash_of(kind, u),
                None => self.scope.url_hash_of(kind, url),
            };
            MediaItem {
                kind: kind.as_str(),
                mime_type: None,
                data: None,
                url: Some(url.to_owned()),
                uuid: uuid.map(str::to_owned),
                mm_hash,
                param: item_path.render(),
                grid_thw: None,
                second_per_grid_ts: None,
                timestamps: None,
            }
        };
        self.items.push(item);
        Ok(self.items.len() - 1)
    }

    /// Adds a metadata-only reference (vLLM's `image_embeds` / `video_embeds` part): no
    /// bytes, only the `uuid` the encoder was given and the grid it reported. The key is
    /// the encoder's key for that uuid as an item of `kind` (same scope; a video's key
    /// covers the request's `media_io_kwargs.video`), so both instances name the output
    /// alike.
    pub fn add_embeds(
        &mut self,
        kind: MediaKind,
        uuid: &str,
        meta: EmbedsMeta,
        item_path: &Path<'_>,
        uuid_path: &Path<'_>,
    ) -> Result<usize> {
        self.check_room(item_path)?;
        check_uuid(uuid, uuid_path)?;
        self.items.push(MediaItem {
            kind: kind.as_str(),
            mime_type: None,
            data: None,
            url: None,
            uuid: Some(uuid.to_owned()),
            mm_hash: self.scope.uuid_hash_of(kind, uuid),
            param: item_path.render(),
            grid_thw: Some(meta.grid_thw),
            second_per_grid_ts: meta.second_per_grid_ts,
            timestamps: meta.timestamps,
        });
        Ok(self.items.len() - 1)
    }

    fn check_room(&self, item_path: &Path<'_>) -> Result<()> {
        if self.items.len() >= self.limits.max_media_items {
            return Err(RequestError::LimitExceeded {
                param: Some(item_path.render()),
                message: format!(
                    "request has more than {} media items",
                    self.limits.max_media_items
                ),
            });
        }
        Ok(())
    }
}

fn check_uuid(uuid: &str, uuid_path: &Path<'_>) -> Result<()> {
    if uuid.is_empty() || uuid.len() > MAX_UUID_LEN {
        return Err(value_error(
            uuid_path,
            format!("'uuid' must be 1 to {MAX_UUID_LEN} bytes long"),
        ));
    }
    Ok(())
}
