//! vLLM's metadata-only `image_embeds` parts: the key agrees with the encoder's key for
//! the same uuid and scope, the grid is read, and malformed parts name their field.

mod common;

use common::{ok, parse, PNG_B64};
use ec_core::Endpoint;

fn chat(part: &str, extra: &str) -> String {
    common::chat_after_text(part, extra)
}

fn embeds(uuid: &str, grid: &str) -> String {
    common::embeds_part("image", uuid, grid)
}

#[test]
fn the_reference_gets_the_encoders_key_for_its_uuid() {
    let url = format!("data:image/png;base64,{PNG_B64}");
    let image = format!(r#"{{"type":"image_url","image_url":{{"url":"{url}"}},"uuid":"u-1"}}"#);
    let scopes = [
        "",
        r#","cache_salt":"tenant-a""#,
        r#","mm_processor_kwargs":{"max_pixels":1000000}"#,
    ];
    let mut keys = Vec::new();
    for extra in scopes {
        let encoder = ok(Endpoint::Chat, &chat(&image, extra));
        let decoder = ok(Endpoint::Chat, &chat(&embeds("u-1", "[1, 4, 6]"), extra));
        let item = &decoder.media[0];
        assert_eq!(item.mm_hash, encoder.media[0].mm_hash, "{extra}");
        assert_eq!(item.grid_thw, Some([1, 4, 6]));
        assert_eq!(encoder.media[0].grid_thw, None);
        assert!(item.data.is_none() && item.url.is_none());
        assert_eq!(item.uuid.as_deref(), Some("u-1"));
        assert_eq!(item.param, "messages[0].content[1].image_embeds");
        keys.push(item.mm_hash.clone());
    }
    keys.dedup();
    assert_eq!(keys.len(), scopes.len(), "each scope gives its own key");
    let other = ok(Endpoint::Chat, &chat(&embeds("u-2", "[1, 4, 6]"), ""));
    assert_ne!(other.media[0].mm_hash, keys[0]);
    // One triple in a list (vLLM's per-item tensor shape) reads the same.
    let nested = ok(Endpoint::Chat, &chat(&embeds("u-1", "[[1, 4, 6]]"), ""));
    assert_eq!(nested.media[0].grid_thw, Some([1, 4, 6]));
}

#[test]
fn malformed_parts_are_refused_naming_the_field() {
    let base = "messages[0].content[1]";
    let cases: Vec<(String, String)> =
        vec![
        (
            r#"{"type":"image_embeds","image_embeds":{"image_grid_thw":[1,4,6]}}"#.into(),
            format!("{base}.uuid"),
        ),
        (
            r#"{"type":"image_embeds","image_embeds":"AAAA","uuid":"u"}"#.into(),
            format!("{base}.image_embeds"),
        ),
        (
            r#"{"type":"image_embeds","uuid":"u"}"#.into(),
            format!("{base}.image_embeds"),
        ),
        (
            r#"{"type":"image_embeds","image_embeds":[1,4,6],"uuid":"u"}"#.into(),
            format!("{base}.image_embeds"),
        ),
        (
            r#"{"type":"image_embeds","image_embeds":{"image_grid_thw":[1,4,6],"x":1},"uuid":"u"}"#
                .into(),
            format!("{base}.image_embeds"),
        ),
        (
            r#"{"type":"image_embeds","image_embeds":{},"uuid":"u"}"#.into(),
            format!("{base}.image_embeds.image_grid_thw"),
        ),
        (embeds("u", "[1, 4]"), format!("{base}.image_embeds.image_grid_thw")),
        (embeds("u", "\"1,4,6\""), format!("{base}.image_embeds.image_grid_thw")),
        (embeds("u", "[1, 0, 6]"), format!("{base}.image_embeds.image_grid_thw[1]")),
        (embeds("u", "[1, -4, 6]"), format!("{base}.image_embeds.image_grid_thw[1]")),
        (embeds("u", "[1, 4, 6.5]"), format!("{base}.image_embeds.image_grid_thw[2]")),
        (embeds("u", "[1, 4, 1e30]"), format!("{base}.image_embeds.image_grid_thw[2]")),
        (embeds("u", "[1, 4, 65537]"), format!("{base}.image_embeds.image_grid_thw[2]")),
        (embeds("", "[1, 4, 6]"), format!("{base}.uuid")),
        (embeds(&"u".repeat(100_000), "[1, 4, 6]"), format!("{base}.uuid")),
    ];
    for (part, param) in cases {
        let err = parse(Endpoint::Chat, &chat(&part, "")).expect_err(&part);
        assert_eq!(err.param(), Some(param.as_str()), "{part}: {err:?}");
    }
}
