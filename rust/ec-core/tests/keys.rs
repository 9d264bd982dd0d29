//! Media keys (DESIGN.md 4.5): a uuid never gives the key of some content, the
//! tenant's `cache_salt` scopes every key, and instances that parse the same item with
//! the same scope agree.

mod common;

use std::collections::HashSet;

use common::{ok, parse, PNG_B64};
use ec_core::{compute_mm_hash, is_valid_mm_hash, Endpoint, KeyScope};

const MODEL: &str = "test-model";

fn image_part(url: &str, uuid: Option<&str>) -> String {
    match uuid {
        Some(u) => format!(r#"{{"type":"image_url","image_url":{{"url":"{url}"}},"uuid":"{u}"}}"#),
        None => format!(r#"{{"type":"image_url","image_url":{{"url":"{url}"}}}}"#),
    }
}

/// A chat body with one image; `extra` is appended to the top-level object.
fn chat(url: &str, uuid: Option<&str>, extra: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what?"}},{}]}}]{extra}}}"#,
        image_part(url, uuid)
    )
}

fn key(endpoint: Endpoint, body: &str) -> String {
    let r = ok(endpoint, body);
    assert_eq!(r.media.len(), 1, "{body}");
    r.media[0].mm_hash.clone()
}

fn png_url() -> String {
    format!("data:image/png;base64,{PNG_B64}")
}

fn png_bytes() -> Vec<u8> {
    ec_core::decode_data_url(&png_url()).expect("test PNG").data
}

#[test]
fn a_uuid_never_takes_the_key_of_content() {
    let victim = compute_mm_hash(&png_bytes(), MODEL, None);
    assert_eq!(key(Endpoint::Chat, &chat(&png_url(), None, "")), victim);
    // The attacker's item names itself by the victim's content hash (or a variant of
    // it), inline or by URL: its key is the uuid's hash, never the uuid.
    let upper = victim.to_uppercase();
    let short = &victim[..32];
    for uuid in [victim.as_str(), upper.as_str(), short] {
        for url in [png_url().as_str(), "https://example.com/a.png"] {
            let got = key(Endpoint::Chat, &chat(url, Some(uuid), ""));
            assert_ne!(got, victim, "{uuid} {url}");
            assert_ne!(got, uuid, "{uuid} {url}");
            assert_eq!(got, KeyScope::new(MODEL, None, None).uuid_hash(uuid));
        }
    }
}

#[test]
fn kinds_of_key_never_collide_on_the_same_bytes() {
    for salt in [None, Some("tenant-a")] {
        let scope = KeyScope::new(MODEL, None, salt);
        for item in ["", "x", "https://example.com/a.png", &"ab".repeat(32)] {
            let keys = [
                scope.content_hash(item.as_bytes()),
                scope.url_hash(item),
                scope.uuid_hash(item),
            ];
            let distinct: HashSet<&String> = keys.iter().collect();
            assert_eq!(distinct.len(), 3, "{item:?} {salt:?}");
            for k in &keys {
                assert!(is_valid_mm_hash(k) && k.len() == 64, "{k}");
            }
        }
    }
}

#[test]
fn cache_salt_scopes_every_kind_of_key() {
    let url = png_url();
    // (image url, uuid): content, URL reference, uuid on inline data, uuid on a URL.
    let items: [(&str, Option<&str>); 4] = [
        (&url, None),
        ("https://example.com/a.png", None),
        (&url, Some("my-image-1")),
        ("https://example.com/a.png", Some("my-image-1")),
    ];
    for (url, uuid) in items {
        let salts = [
            "",
            r#","cache_salt":null"#,
            r#","cache_salt":"tenant-a""#,
            r#","cache_salt":"tenant-b""#,
        ];
        let keys: Vec<String> = salts
            .iter()
            .map(|s| key(Endpoint::Chat, &chat(url, uuid, s)))
            .collect();
        assert_eq!(keys[0], keys[1], "null is no salt: {url} {uuid:?}");
        let distinct: HashSet<&String> = keys[1..].iter().collect();
        assert_eq!(distinct.len(), 3, "{url} {uuid:?}: {keys:?}");
    }
}

#[test]
fn salt_presence_is_framed() {
    // No salt, an empty salt and salts whose bytes could shift into the neighbouring
    // fields all differ (the parser rejects an empty salt; the scope still tells it apart).
    let scopes = [
        KeyScope::new("ab", None, None),
        KeyScope::new("ab", None, Some("")),
        KeyScope::new("a", None, Some("b")),
        KeyScope::new("ab", None, Some("c")),
    ];
    let keys: HashSet<String> = scopes.iter().map(|s| s.uuid_hash("c")).collect();
    assert_eq!(keys.len(), scopes.len());
    let keys: HashSet<String> = scopes.iter().map(|s| s.content_hash(b"c")).collect();
    assert_eq!(keys.len(), scopes.len());
}

#[test]
fn encoder_and_prefill_decode_agree_on_uuid_keys() {
    // vLLM's EPD proxy sends the encoder a copy of the request cut to one token and the
    // prefill/decode instance the request itself: both carry the same uuid, salt and
    // processor kwargs, so both must derive the same key, and the responses endpoint
    // must agree with chat.
    let url = png_url();
    let scope = r#","cache_salt":"tenant-a","mm_processor_kwargs":{"max_pixels":50176}"#;
    let encoder = key(
        Endpoint::Chat,
        &chat(
            &url,
            Some("item-7"),
            &format!(r#"{scope},"max_tokens":1,"stream":false"#),
        ),
    );
    let decoder = key(
        Endpoint::Chat,
        &chat(
            &url,
            Some("item-7"),
            &format!(r#"{scope},"max_tokens":64,"stream":true,"temperature":0"#),
        ),
    );
    assert_eq!(encoder, decoder);
    let responses = format!(
        r#"{{"input":[{{"role":"user","content":[{{"type":"input_image","image_url":"{url}","uuid":"item-7"}}]}}]{scope}}}"#
    );
    assert_eq!(key(Endpoint::Responses, &responses), encoder);
    let kwargs =
        ec_core::parse_str(r#"{"max_pixels":50176}"#, &Default::default()).expect("kwargs JSON");
    let expected = KeyScope::new(MODEL, Some(&kwargs), Some("tenant-a")).uuid_hash("item-7");
    assert_eq!(encoder, expected);
    // Another salt, other kwargs or another model: another key.
    assert_ne!(
        key(
            Endpoint::Chat,
            &chat(
                &url,
                Some("item-7"),
                r#","cache_salt":"tenant-b","mm_processor_kwargs":{"max_pixels":50176}"#
            )
        ),
        encoder
    );
    assert_ne!(
        key(
            Endpoint::Chat,
            &chat(&url, Some("item-7"), r#","cache_salt":"tenant-a""#)
        ),
        encoder
    );
    let other_model = ec_core::parse_request(
        Endpoint::Chat,
        chat(&url, Some("item-7"), scope).as_bytes(),
        "other-model",
        &Default::default(),
    )
    .expect("valid");
    assert_ne!(other_model.media[0].mm_hash, encoder);
}

#[test]
fn cache_salt_follows_vllm_rules() {
    let hi = r#""messages":[{"role":"user","content":"hi"}]"#;
    // (endpoint, body, Ok(parsed salt) | Err((code, param)))
    type Row<'a> = (
        Endpoint,
        String,
        Result<Option<&'a str>, (&'a str, &'a str)>,
    );
    let rows: Vec<Row<'_>> = vec![
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":"s3cr3t"}}"#),
            Ok(Some("s3cr3t")),
        ),
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":null}}"#),
            Ok(None),
        ),
        (Endpoint::Chat, format!(r#"{{{hi}}}"#), Ok(None)),
        (
            Endpoint::Completions,
            r#"{"prompt":"x","cache_salt":"t"}"#.into(),
            Ok(Some("t")),
        ),
        (
            Endpoint::Responses,
            r#"{"input":"x","cache_salt":"t"}"#.into(),
            Ok(Some("t")),
        ),
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":""}}"#),
            Err(("invalid_value", "cache_salt")),
        ),
        (
            Endpoint::Completions,
            r#"{"prompt":"x","cache_salt":""}"#.into(),
            Err(("invalid_value", "cache_salt")),
        ),
        (
            Endpoint::Responses,
            r#"{"input":"x","cache_salt":""}"#.into(),
            Err(("invalid_value", "cache_salt")),
        ),
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":7}}"#),
            Err(("invalid_type", "cache_salt")),
        ),
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":["a"]}}"#),
            Err(("invalid_type", "cache_salt")),
        ),
        (
            Endpoint::Chat,
            format!(r#"{{{hi},"cache_salt":true}}"#),
            Err(("invalid_type", "cache_salt")),
        ),
    ];
    for (endpoint, body, expected) in rows {
        match (parse(endpoint, &body), expected) {
            (Ok(r), Ok(salt)) => {
                assert_eq!(r.cache_salt.as_deref(), salt, "{body}");
                assert!(r.unknown_fields.is_empty(), "{body}");
                let view = common::json(&r);
                assert_eq!(view["cache_salt"], serde_json::json!(salt), "{body}");
            }
            (Err(e), Err((code, param))) => {
                assert_eq!((e.code(), e.param()), (code, Some(param)), "{body}: {e}");
            }
            (got, want) => panic!("{body}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn generate_names_its_keys_itself() {
    // Generate requests carry keys computed upstream; a salt there has nothing to
    // scope, so it is an ignored (listed) field as any unknown one.
    let r = ok(
        Endpoint::Generate,
        r#"{"token_ids":[1,2],"cache_salt":"t"}"#,
    );
    assert_eq!(r.cache_salt, None);
    assert_eq!(r.unknown_fields, ["cache_salt"]);
}
