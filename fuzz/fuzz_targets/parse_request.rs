//! `parse_request` on every endpoint. The first byte picks the endpoint (bits 0-1) and
//! the limits (bit 2: tight ones, so that small inputs reach every limit check); the
//! rest is the body. Any panic is a crash; an accepted request must also keep the
//! parser's promises, checked below.

#![no_main]

use ec_core::{
    is_valid_mm_hash, parse_request, Endpoint, KeyScope, MediaKind, Limits, MediaItem, ParsedRequest, Part,
    Prompt,
};
use libfuzzer_sys::fuzz_target;

const MODEL_ID: &str = "fuzz-model";

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::Chat,
    Endpoint::Completions,
    Endpoint::Responses,
    Endpoint::Generate,
];

const TIGHT: Limits = Limits {
    max_body_bytes: 4096,
    max_depth: 6,
    max_messages: 4,
    max_media_items: 2,
    max_string_bytes: 256,
    max_media_bytes: 512,
    max_token_ids: 16,
};

fuzz_target!(|input: &[u8]| {
    let Some((&selector, body)) = input.split_first() else {
        return;
    };
    let endpoint = ENDPOINTS[usize::from(selector & 3)];
    let limits = if selector & 4 == 0 {
        Limits::default()
    } else {
        TIGHT
    };
    match parse_request(endpoint, body, MODEL_ID, &limits) {
        Ok(request) => check(endpoint, &request, &limits),
        Err(e) => {
            assert!(!e.code().is_empty());
            assert!(!e.to_string().is_empty());
        }
    }
});

fn check(endpoint: Endpoint, r: &ParsedRequest, limits: &Limits) {
    assert_eq!(r.endpoint, endpoint);
    assert!(r.media.len() <= limits.max_media_items);
    let media_bytes: usize = r.media.iter().map(MediaItem::len).sum();
    assert!(media_bytes <= limits.max_media_bytes);
    let video = r
        .media_io_kwargs
        .as_ref()
        .and_then(|kwargs| kwargs.get("video"));
    let scope = KeyScope::new(
        MODEL_ID,
        r.mm_processor_kwargs.as_ref(),
        r.cache_salt.as_deref(),
    )
    .with_video_options(video);
    for item in &r.media {
        assert!(is_valid_mm_hash(&item.mm_hash) && item.mm_hash.len() == 64);
        let kind = if item.kind == "video" {
            MediaKind::Video
        } else {
            MediaKind::Image
        };
        let expected = match (&item.uuid, &item.data, &item.url) {
            (Some(uuid), _, _) => scope.uuid_hash_of(kind, uuid),
            (None, Some(data), None) => scope.content_hash_of(kind, data),
            (None, None, Some(url)) => scope.url_hash_of(kind, url),
            other => panic!("an item is inline data or a URL: {other:?}"),
        };
        assert_eq!(item.mm_hash, expected);
    }
    assert!(r.cache_salt.as_deref() != Some(""));
    // Image parts refer to the media items once each, in order.
    let images: Vec<usize> = r
        .messages
        .iter()
        .flatten()
        .flat_map(|m| &m.content)
        .filter_map(|p| match p {
            Part::Image { media_index } | Part::Video { media_index } => Some(*media_index),
            Part::Text { .. } => None,
        })
        .collect();
    assert!(images.iter().copied().eq(0..r.media.len()));
    assert!(r.messages.as_ref().map_or(0, Vec::len) <= limits.max_messages);
    let prompt_ids: usize = r
        .prompts
        .iter()
        .flatten()
        .map(|p| match p {
            Prompt::Tokens(ids) => ids.len(),
            Prompt::Text(_) => 0,
        })
        .sum();
    let token_ids = r.token_ids.as_ref().map_or(0, Vec::len);
    assert!(prompt_ids <= limits.max_token_ids && token_ids <= limits.max_token_ids);
    if let Some(f) = &r.features {
        assert_eq!(f.mm_hashes.len(), f.mm_placeholders.len());
        let mut end = 0;
        for p in &f.mm_placeholders {
            assert!(p.offset >= end && p.length >= 1);
            end = p.offset + p.length;
            assert!(end <= token_ids);
        }
    }
    assert!(r.sampling.n >= 1);
    let _ = (r.kv_transfer_params(), r.ec_transfer_params());
    let view = r.to_json();
    assert!(
        serde_json::from_str::<serde::de::IgnoredAny>(&view).is_ok(),
        "{view}"
    );
}
