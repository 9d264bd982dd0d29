//! vLLM's metadata-only `video_embeds` parts: the key agrees with the encoder's key for
//! the same uuid, scope and sampling options (and never with an image's), the grid is
//! read, and malformed parts name their field.

mod common;

use common::{ok, parse};
use ec_core::{Endpoint, Part};

const VIDEO_URL: &str = "data:video/mp4;base64,AAAAGGZ0eXBtcDQyAAAAAG1wNDJpc29t";

fn chat(part: &str, extra: &str) -> String {
    common::chat_after_text(part, extra)
}

fn embeds(uuid: &str, grid: &str) -> String {
    common::embeds_part("video", uuid, grid)
}

#[test]
fn the_reference_gets_the_encoders_key_for_its_uuid_and_sampling() {
    let video =
        format!(r#"{{"type":"video_url","video_url":{{"url":"{VIDEO_URL}"}},"uuid":"v-1"}}"#);
    let image = r#"{"type":"image_embeds","image_embeds":{"image_grid_thw":[1,4,6]},"uuid":"v-1"}"#;
    let scopes = [
        "",
        r#","cache_salt":"tenant-a""#,
        r#","media_io_kwargs":{"video":{"num_frames":4}}"#,
        r#","media_io_kwargs":{"video":{"num_frames":8}}"#,
    ];
    let mut keys = Vec::new();
    for extra in scopes {
        let encoder = ok(Endpoint::Chat, &chat(&video, extra));
        let decoder = ok(Endpoint::Chat, &chat(&embeds("v-1", "[4, 4, 6]"), extra));
        let item = &decoder.media[0];
        assert_eq!(item.kind, "video");
        assert_eq!(item.mm_hash, encoder.media[0].mm_hash, "{extra}");
        assert_eq!(item.grid_thw, Some([4, 4, 6]));
        assert!(item.data.is_none() && item.url.is_none());
        assert_eq!(item.param, "messages[0].content[1].video_embeds");
        let messages = decoder.messages.as_ref().expect("chat messages");
        assert!(matches!(
            messages[0].content[1],
            Part::Video { media_index: 0 }
        ));
        let as_image = ok(Endpoint::Chat, &chat(image, extra));
        assert_ne!(
            as_image.media[0].mm_hash, item.mm_hash,
            "a video never shares an image's key"
        );
        keys.push(item.mm_hash.clone());
    }
    keys.dedup();
    assert_eq!(
        keys.len(),
        scopes.len(),
        "each scope and sampling gives its own key"
    );
    let nested = ok(Endpoint::Chat, &chat(&embeds("v-1", "[[4, 4, 6]]"), ""));
    assert_eq!(nested.media[0].grid_thw, Some([4, 4, 6]));
}

#[test]
fn malformed_parts_are_refused_naming_the_field() {
    let base = "messages[0].content[1]";
    let cases: Vec<(String, String)> = vec![
        (
            r#"{"type":"video_embeds","video_embeds":{"video_grid_thw":[2,4,6]}}"#.into(),
            format!("{base}.uuid"),
        ),
        (
            r#"{"type":"video_embeds","video_embeds":"AAAA","uuid":"u"}"#.into(),
            format!("{base}.video_embeds"),
        ),
        (
            r#"{"type":"video_embeds","video_embeds":{"image_grid_thw":[1,4,6]},"uuid":"u"}"#
                .into(),
            format!("{base}.video_embeds"),
        ),
        (
            r#"{"type":"video_embeds","video_embeds":{"video_grid_thw":[2,4,6],"timestamps":[0]},"uuid":"u"}"#
                .into(),
            format!("{base}.video_embeds"),
        ),
        (embeds("u", "[2, 4]"), format!("{base}.video_embeds.video_grid_thw")),
        (embeds("u", "[0, 4, 6]"), format!("{base}.video_embeds.video_grid_thw[0]")),
        (embeds("u", "[2, 4, 65537]"), format!("{base}.video_embeds.video_grid_thw[2]")),
        (embeds("", "[2, 4, 6]"), format!("{base}.uuid")),
    ];
    for (part, param) in cases {
        let err = parse(Endpoint::Chat, &chat(&part, "")).expect_err(&part);
        assert_eq!(err.param(), Some(param.as_str()), "{part}: {err:?}");
    }
}
