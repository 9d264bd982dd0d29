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
            r#"{"type":"video_embeds","video_embeds":{"video_grid_thw":[2,4,6],"fps":[2]},"uuid":"u"}"#
                .into(),
            format!("{base}.video_embeds"),
        ),
        (embeds("u", "[2, 4]"), format!("{base}.video_embeds.video_grid_thw")),
        (embeds("u", "[0, 4, 6]"), format!("{base}.video_embeds.video_grid_thw[0]")),
        (embeds("u", "[2, 4, 65537]"), format!("{base}.video_embeds.video_grid_thw[2]")),
        (embeds("", "[2, 4, 6]"), format!("{base}.uuid")),
        (
            timed("[2, 4, 6]", "0.5", ",\"x\":1"),
            format!("{base}.video_embeds"),
        ),
        (
            timed("[2, 4]", "0.5", ""),
            format!("{base}.video_embeds.video_grid_thw"),
        ),
    ];
    for (part, param) in cases {
        let err = parse(Endpoint::Chat, &chat(&part, "")).expect_err(&part);
        assert_eq!(err.param(), Some(param.as_str()), "{part}: {err:?}");
    }
}

/// A `video_embeds` part with `second_per_grid_ts` (`seconds`, raw JSON) beside its
/// grid, and `extra` (raw JSON members, each after a comma) in the metadata.
fn timed(grid: &str, seconds: &str, extra: &str) -> String {
    format!(
        r#"{{"type":"video_embeds","video_embeds":{{"video_grid_thw":{grid},"second_per_grid_ts":{seconds}{extra}}},"uuid":"v-1"}}"#
    )
}

#[test]
fn second_per_grid_ts_is_read_beside_the_grid_bare_or_as_a_list_of_one() {
    let cases = [
        ("0.75", 0.75),
        ("[0.75]", 0.75),
        ("2", 2.0),
        ("[1.3333333333333333]", 4.0 / 3.0),
        ("86400", 86_400.0),
        ("1e-9", 1e-9),
    ];
    let bare = ok(Endpoint::Chat, &chat(&embeds("v-1", "[4, 4, 6]"), ""));
    for (raw, want) in cases {
        let parsed = ok(Endpoint::Chat, &chat(&timed("[4, 4, 6]", raw, ""), ""));
        let item = &parsed.media[0];
        assert_eq!(item.second_per_grid_ts, Some(want), "{raw}");
        assert_eq!(item.grid_thw, Some([4, 4, 6]));
        assert_eq!(
            item.mm_hash, bare.media[0].mm_hash,
            "the seconds are not in the key"
        );
    }
    assert_eq!(bare.media[0].second_per_grid_ts, None);
    let null = ok(Endpoint::Chat, &chat(&timed("[4, 4, 6]", "null", ""), ""));
    assert_eq!(null.media[0].second_per_grid_ts, None);
    // The metadata's keys in any order.
    let first = r#"{"type":"video_embeds","video_embeds":{"second_per_grid_ts":[0.5],"video_grid_thw":[[4,4,6]]},"uuid":"v-1"}"#;
    let parsed = ok(Endpoint::Chat, &chat(first, ""));
    assert_eq!(parsed.media[0].second_per_grid_ts, Some(0.5));
    assert_eq!(parsed.media[0].grid_thw, Some([4, 4, 6]));
}

#[test]
fn bad_second_per_grid_ts_is_refused_naming_it() {
    let at = "messages[0].content[1].video_embeds.second_per_grid_ts";
    let cases = [
        ("0", at.to_owned()),
        ("-0.5", at.to_owned()),
        ("86400.5", at.to_owned()),
        ("1e308", at.to_owned()),
        ("\"0.5\"", at.to_owned()),
        ("true", at.to_owned()),
        ("{}", at.to_owned()),
        ("[]", at.to_owned()),
        ("[0.5, 0.5]", at.to_owned()),
        ("[[0.5]]", format!("{at}[0]")),
        ("[0]", format!("{at}[0]")),
        ("[\"0.5\"]", format!("{at}[0]")),
    ];
    for (raw, param) in cases {
        let part = timed("[2, 4, 6]", raw, "");
        let err = parse(Endpoint::Chat, &chat(&part, "")).expect_err(raw);
        assert_eq!(err.param(), Some(param.as_str()), "{raw}: {err:?}");
        assert!(
            err.to_string().contains("second_per_grid_ts"),
            "{raw}: {err}"
        );
    }
    // Only a video reference takes it.
    let image = r#"{"type":"image_embeds","image_embeds":{"image_grid_thw":[1,4,6],"second_per_grid_ts":0.5},"uuid":"u"}"#;
    let err = parse(Endpoint::Chat, &chat(image, "")).expect_err(image);
    assert_eq!(err.param(), Some("messages[0].content[1].image_embeds"));
}

/// A `video_embeds` part with `timestamps` (`times`, raw JSON) beside its grid.
fn stamped(grid: &str, times: &str) -> String {
    format!(
        r#"{{"type":"video_embeds","video_embeds":{{"video_grid_thw":{grid},"timestamps":{times}}},"uuid":"v-1"}}"#
    )
}

#[test]
fn timestamps_are_read_one_per_temporal_patch_and_stay_out_of_the_key() {
    let bare = ok(Endpoint::Chat, &chat(&embeds("v-1", "[3, 4, 6]"), ""));
    assert_eq!(bare.media[0].timestamps, None);
    for (raw, want) in [
        ("[0.25, 1.5, 2]", vec![0.25, 1.5, 2.0]),
        ("[0, 0, 86400]", vec![0.0, 0.0, 86_400.0]),
    ] {
        let parsed = ok(Endpoint::Chat, &chat(&stamped("[3, 4, 6]", raw), ""));
        let item = &parsed.media[0];
        assert_eq!(item.timestamps.as_deref(), Some(want.as_slice()), "{raw}");
        assert_eq!(item.grid_thw, Some([3, 4, 6]));
        assert_eq!(
            item.mm_hash, bare.media[0].mm_hash,
            "the times are not in the key"
        );
    }
    let null = ok(Endpoint::Chat, &chat(&stamped("[3, 4, 6]", "null"), ""));
    assert_eq!(null.media[0].timestamps, None);
    // Beside second_per_grid_ts, the keys in any order (the model says which it takes).
    let both = r#"{"type":"video_embeds","video_embeds":{"timestamps":[0.5],"second_per_grid_ts":[1.0],"video_grid_thw":[[1,4,6]]},"uuid":"v-1"}"#;
    let parsed = ok(Endpoint::Chat, &chat(both, ""));
    assert_eq!(parsed.media[0].timestamps, Some(vec![0.5]));
    assert_eq!(parsed.media[0].second_per_grid_ts, Some(1.0));
}

#[test]
fn bad_timestamps_are_refused_naming_them() {
    let at = "messages[0].content[1].video_embeds.timestamps";
    let cases = [
        ("[0.5, 1.5]", at.to_owned(), "3 (the grid's t), got 2"),
        ("[0.5, 1.5, 2, 3]", at.to_owned(), "got 4"),
        ("[]", at.to_owned(), "got 0"),
        ("0.5", at.to_owned(), "timestamps"),
        ("\"0.5\"", at.to_owned(), "timestamps"),
        ("[0.5, -1, 2]", format!("{at}[1]"), "timestamps[1]"),
        ("[0.5, 1, 86400.5]", format!("{at}[2]"), "timestamps[2]"),
        ("[0.5, 1, 1e308]", format!("{at}[2]"), "timestamps[2]"),
        ("[0.5, \"1\", 2]", format!("{at}[1]"), "timestamps[1]"),
        ("[0.5, [1], 2]", format!("{at}[1]"), "timestamps[1]"),
    ];
    for (raw, param, words) in cases {
        let part = stamped("[3, 4, 6]", raw);
        let err = parse(Endpoint::Chat, &chat(&part, "")).expect_err(raw);
        assert_eq!(err.param(), Some(param.as_str()), "{raw}: {err:?}");
        assert!(err.to_string().contains(words), "{raw}: {err}");
    }
    // Only a video reference takes them.
    let image = r#"{"type":"image_embeds","image_embeds":{"image_grid_thw":[1,4,6],"timestamps":[0.5]},"uuid":"u"}"#;
    let err = parse(Endpoint::Chat, &chat(image, "")).expect_err(image);
    assert_eq!(err.param(), Some("messages[0].content[1].image_embeds"));
}
