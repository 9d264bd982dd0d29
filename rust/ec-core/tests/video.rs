//! `video_url` parts and `media_io_kwargs`: video items as vLLM 0.33 takes them, and
//! video keys that cover the sampling options (one video sampled two ways is two items).

mod common;

use std::collections::HashSet;

use common::{json, ok, parse, PNG_B64};
use ec_core::{Endpoint, KeyScope, MediaKind, Part};
use serde_json::json;

/// Any bytes will do: the parser does not look inside a video.
const VIDEO_B64: &str = "AAAAGGZ0eXBtcDQyAAAAAG1wNDJpc29t";

fn video_url() -> String {
    format!("data:video/mp4;base64,{VIDEO_B64}")
}

fn video_part(url: &str, uuid: Option<&str>) -> String {
    match uuid {
        Some(u) => format!(r#"{{"type":"video_url","video_url":{{"url":"{url}"}},"uuid":"{u}"}}"#),
        None => format!(r#"{{"type":"video_url","video_url":{{"url":"{url}"}}}}"#),
    }
}

fn chat(parts: &[String], extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what?"}},{}]}}]{extra}}}"#,
        parts.join(",")
    )
}

fn video_key(body: &str) -> String {
    let r = ok(Endpoint::Chat, body);
    assert_eq!(r.media.len(), 1, "{body}");
    assert_eq!(r.media[0].kind, "video");
    r.media[0].mm_hash.clone()
}

#[test]
fn video_parts_become_video_items() {
    let image = format!(
        r#"{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{PNG_B64}"}}}}"#
    );
    let body = chat(
        &[
            video_part(&video_url(), None),
            image,
            video_part("https://example.com/clip.mp4", Some("clip-1")),
            r#"{"type":"video_url","video_url":"file:///media/a.webm"}"#.into(),
        ],
        "",
    );
    let r = ok(Endpoint::Chat, &body);
    let content = &r.messages.as_ref().expect("messages")[0].content;
    assert_eq!(content[1], Part::Video { media_index: 0 });
    assert_eq!(content[2], Part::Image { media_index: 1 });
    assert_eq!(content[3], Part::Video { media_index: 2 });
    assert_eq!(content[4], Part::Video { media_index: 3 });
    let kinds: Vec<_> = r.media.iter().map(|m| m.kind).collect();
    assert_eq!(kinds, ["video", "image", "video", "video"]);
    assert_eq!(r.media[0].mime_type.as_deref(), Some("video/mp4"));
    assert_eq!(r.media[0].len(), 24);
    assert_eq!(
        r.media[2].url.as_deref(),
        Some("https://example.com/clip.mp4")
    );
    assert_eq!(r.media[2].uuid.as_deref(), Some("clip-1"));
    assert_eq!(r.media[0].param, "messages[0].content[1].video_url");
    let v = json(&r);
    assert_eq!(
        v["messages"][0]["content"][1],
        json!({"type": "video", "media_index": 0})
    );
}

#[test]
fn bad_video_parts_are_refused_with_their_path() {
    // (body, param, words in the message)
    let rows: Vec<(String, &str, &str)> = vec![
        (
            chat(
                &[video_part(
                    &format!("data:image/png;base64,{PNG_B64}"),
                    None,
                )],
                "",
            ),
            "messages[0].content[1].video_url.url",
            "video/*",
        ),
        (
            chat(
                &[
                    video_part(&format!("data:video/mp4;base64,{PNG_B64}"), None)
                        .replace("video_url\":{", "image_url\":{")
                        .replacen("\"type\":\"video_url\"", "\"type\":\"image_url\"", 1),
                ],
                "",
            ),
            "messages[0].content[1].image_url.url",
            "image/*",
        ),
        (
            chat(&[video_part("ftp://example.com/a.mp4", None)], ""),
            "messages[0].content[1].video_url.url",
            "video URL must be",
        ),
        (
            chat(&[r#"{"type":"video_url"}"#.into()], ""),
            "messages[0].content[1].video_url",
            "",
        ),
        (
            chat(&[r#"{"type":"video_url","video_url":7}"#.into()], ""),
            "messages[0].content[1].video_url",
            "",
        ),
        (
            chat(&[video_part("data:video/mp4;base64,", None)], ""),
            "messages[0].content[1].video_url.url",
            "empty",
        ),
        (
            chat(&[video_part(&video_url(), Some(""))], ""),
            "messages[0].content[1].uuid",
            "uuid",
        ),
    ];
    // (media_io_kwargs beside one video part, param, words in the message)
    #[rustfmt::skip]
    let options: [(&str, &str, &str); 7] = [
        (r#"{"video":{"num_frames":2.5}}"#, "media_io_kwargs.video.num_frames", ""),
        (r#"{"video":{"num_frames":-2}}"#, "media_io_kwargs.video.num_frames", ""),
        (r#"{"video":{"backend":"opencv"}}"#, "media_io_kwargs.video.backend", "num_frames or fps"),
        (r#"{"audio":{}}"#, "media_io_kwargs.audio", "only 'video'"),
        (r#"{"image":{"x":1}}"#, "media_io_kwargs.image", "only 'video'"),
        (r#"[1]"#, "media_io_kwargs", ""),
        (r#"{"video":{"fps":"fast"}}"#, "media_io_kwargs.video.fps", ""),
    ];
    let part = video_part(&video_url(), None);
    let rows = rows
        .into_iter()
        .chain(options.into_iter().map(|(kwargs, param, words)| {
            let extra = format!(r#","media_io_kwargs":{kwargs}"#);
            (chat(std::slice::from_ref(&part), &extra), param, words)
        }));
    for (body, param, words) in rows {
        let err = parse(Endpoint::Chat, &body).expect_err(&body);
        assert_eq!(err.param(), Some(param), "{body}: {err:?}");
        assert!(err.to_string().contains(words), "{body}: {err}");
    }
}

#[test]
fn media_io_kwargs_are_kept_and_harmless_values_pass() {
    let part = video_part(&video_url(), None);
    let r = ok(
        Endpoint::Chat,
        &chat(
            std::slice::from_ref(&part),
            r#","media_io_kwargs":{"video":{"num_frames":4,"fps":2.5},"image":{}}"#,
        ),
    );
    assert_eq!(
        json(&r)["media_io_kwargs"],
        json!({"video": {"num_frames": 4, "fps": 2.5}, "image": {}})
    );
    for extra in [r#","media_io_kwargs":{}"#, r#","media_io_kwargs":null"#, ""] {
        ok(Endpoint::Chat, &chat(std::slice::from_ref(&part), extra));
    }
}

#[test]
fn a_video_key_covers_its_sampling_options() {
    let part = video_part(&video_url(), None);
    let by_uuid = video_part(&video_url(), Some("clip-1"));
    let by_url = video_part("https://example.com/clip.mp4", None);
    let options = [
        "",
        r#","media_io_kwargs":{"video":{"num_frames":4}}"#,
        r#","media_io_kwargs":{"video":{"num_frames":8}}"#,
        r#","media_io_kwargs":{"video":{"fps":1}}"#,
        r#","media_io_kwargs":{"video":{"num_frames":4,"fps":1}}"#,
        r#","mm_processor_kwargs":{"max_pixels":12544}"#,
    ];
    let mut seen = HashSet::new();
    for source in [&part, &by_uuid, &by_url] {
        for extra in options {
            let key = video_key(&chat(std::slice::from_ref(source), extra));
            assert!(seen.insert(key), "{source} {extra}: a key repeats");
            // The same request parsed again (another instance) gives the same key, and
            // the order of the options does not matter.
            assert!(seen.contains(&video_key(&chat(std::slice::from_ref(source), extra))));
        }
    }
    let swapped = video_key(&chat(
        std::slice::from_ref(&part),
        r#","media_io_kwargs":{"video":{"fps":1,"num_frames":4}}"#,
    ));
    assert!(seen.contains(&swapped));
    // Sampling options never change an image's key.
    let image = format!(
        r#"{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{PNG_B64}"}}}}"#
    );
    let plain = ok(Endpoint::Chat, &chat(std::slice::from_ref(&image), "")).media[0]
        .mm_hash
        .clone();
    let sampled = ok(Endpoint::Chat, &chat(&[image], options[1])).media[0]
        .mm_hash
        .clone();
    assert_eq!(plain, sampled);
}

#[test]
fn video_keys_match_the_scope_and_never_an_image_key() {
    let data = ec_core::decode_data_url(&video_url())
        .expect("data URL")
        .data;
    let options = json!({"num_frames": 4}).to_string();
    let owned = ec_core::parse_str(&options, &ec_core::Limits::default()).expect("json");
    let scope = KeyScope::new("test-model", None, None).with_video_options(Some(&owned));
    let body = chat(
        &[video_part(&video_url(), None)],
        r#","media_io_kwargs":{"video":{"num_frames":4}}"#,
    );
    assert_eq!(
        video_key(&body),
        scope.content_hash_of(MediaKind::Video, &data)
    );
    // The same bytes as an image, with or without the options, key differently.
    assert_ne!(
        scope.content_hash_of(MediaKind::Image, &data),
        scope.content_hash_of(MediaKind::Video, &data)
    );
    assert_eq!(
        scope.content_hash_of(MediaKind::Image, &data),
        scope.content_hash(&data)
    );
    assert_ne!(
        scope.uuid_hash_of(MediaKind::Video, "u"),
        scope.uuid_hash("u")
    );
    assert_ne!(
        scope.url_hash_of(MediaKind::Video, "https://a/b"),
        scope.url_hash("https://a/b")
    );
}
