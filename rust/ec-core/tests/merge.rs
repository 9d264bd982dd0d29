//! DESIGN.md 4.1: merge semantics, table-driven over JSON inputs.

use ec_core::{merge_ec_transfer_params, merge_kv_transfer_params, parse_str, Limits, Value};

fn value(text: &str) -> Value<'_> {
    parse_str(text, &Limits::default()).expect("valid JSON")
}

fn opt(text: Option<&str>) -> Option<Value<'_>> {
    text.map(value)
}

#[test]
fn merge_table() {
    // (xargs, params, expected result); None is an absent value / a None result.
    let rows: &[(Option<&str>, Option<&str>, Option<&str>)] = &[
        (None, None, None),
        (None, Some("{}"), Some(r#"{"ec_transfer_params":{}}"#)),
        (Some("{}"), None, Some("{}")),
        (Some(r#"{"a":1}"#), None, Some(r#"{"a":1}"#)),
        (Some("{}"), Some("{}"), Some(r#"{"ec_transfer_params":{}}"#)),
        (
            Some(r#"{"a":1}"#),
            Some(r#"{"h":{"peer_port":5501}}"#),
            Some(r#"{"a":1,"ec_transfer_params":{"h":{"peer_port":5501}}}"#),
        ),
        (
            Some(r#"{"ec_transfer_params":{"old":1},"b":2}"#),
            Some(r#"{"new":2}"#),
            Some(r#"{"b":2,"ec_transfer_params":{"new":2}}"#),
        ),
        (
            Some(r#"{"ec_transfer_params":{"old":1}}"#),
            Some("{}"),
            Some(r#"{"ec_transfer_params":{}}"#),
        ),
        (
            Some(r#"{"ec_transfer_params":{"old":1}}"#),
            None,
            Some(r#"{"ec_transfer_params":{"old":1}}"#),
        ),
        (
            None,
            Some(r#"{"k":"\u00fc\u6f22\ud83d\ude00"}"#),
            Some(r#"{"ec_transfer_params":{"k":"ü漢😀"}}"#),
        ),
        (
            None,
            Some(
                r#"{"big":123456789012345678901234567890,"neg":-98765432109876543210,"u":18446744073709551615}"#,
            ),
            Some(
                r#"{"ec_transfer_params":{"big":123456789012345678901234567890,"neg":-98765432109876543210,"u":18446744073709551615}}"#,
            ),
        ),
        (
            None,
            Some(r#"{"f":0.1,"e":1e300,"n":null,"t":true,"l":[1,[2,[3]]]}"#),
            Some(r#"{"ec_transfer_params":{"f":0.1,"e":1e300,"n":null,"t":true,"l":[1,[2,[3]]]}}"#),
        ),
    ];
    for (xargs, params, expected) in rows {
        let x = opt(*xargs);
        let p = opt(*params);
        let before = (x.clone(), p.clone());
        let got = merge_ec_transfer_params(x.as_ref(), p.as_ref());
        assert_eq!(got, opt(*expected), "merge({xargs:?}, {params:?})");
        assert_eq!((x, p), before, "inputs must not change");
    }
}

#[test]
fn kv_and_ec_compose() {
    let xargs = value(r#"{"x":1}"#);
    let kv = value(r#"{"do_remote_decode":true}"#);
    let ec = value("{}");
    let once = merge_kv_transfer_params(Some(&xargs), Some(&kv));
    let both = merge_ec_transfer_params(once.as_ref(), Some(&ec));
    assert_eq!(
        both,
        Some(value(
            r#"{"x":1,"kv_transfer_params":{"do_remote_decode":true},"ec_transfer_params":{}}"#
        ))
    );
    assert_eq!(xargs, value(r#"{"x":1}"#));
}

#[test]
fn values_round_trip_exactly() {
    let docs = [
        r#"{"a":[1,-2,3.5,1e-7,true,false,null,"s"],"b":{"c":{}}}"#,
        r#"[123456789012345678901234567890,-123456789012345678901234567890]"#,
        r#""esc \" \\ \n \t \u0001 ü""#,
        "18446744073709551615",
        "-9223372036854775808",
    ];
    for doc in docs {
        let v = value(doc);
        let ours = serde_json::to_string(&v).expect("serializes");
        let reference: serde_json::Value = serde_json::from_str(doc).expect("valid");
        let again: serde_json::Value = serde_json::from_str(&ours).expect("valid output");
        assert_eq!(again, reference, "{doc}");
    }
}

#[test]
fn canonical_json_is_order_free() {
    let a = value(r#"{"b":1,"a":{"y":[1,2],"x":"\u00e9"},"c":1.5}"#);
    let b = value(r#"{"c":1.5,"a":{"x":"é","y":[1,2]},"b":1}"#);
    assert_eq!(a.canonical_json(), b.canonical_json());
    assert_eq!(
        a.canonical_json(),
        r#"{"a":{"x":"é","y":[1,2]},"b":1,"c":1.5}"#
    );
    let dup = value(r#"{"k":1,"k":2}"#);
    assert_eq!(dup.canonical_json(), r#"{"k":2}"#);
    assert_ne!(value("1").canonical_json(), value("1.0").canonical_json());
}

#[test]
fn data_urls_and_hashes() {
    let png = "data:image/png;base64,aGVsbG8=";
    type Decoded<'a> = Result<(&'a str, &'a [u8]), &'a str>;
    let rows: &[(&str, Decoded<'_>)] = &[
        (png, Ok(("image/png", b"hello"))),
        ("data:image/png;base64,aGVsbG8", Ok(("image/png", b"hello"))),
        (
            "DATA:IMAGE/JPEG;BASE64,aGVs\nbG8=",
            Ok(("image/jpeg", b"hello")),
        ),
        ("data:;base64,aGVsbG8=", Ok(("text/plain", b"hello"))),
        ("data:image/png;base64,aGVsbG8*", Err("invalid_base64")),
        ("data:image/png;base64,", Err("invalid_data_url")),
        ("data:image/png,hello", Err("invalid_data_url")),
        ("http://x/y.png", Err("invalid_data_url")),
        ("data:image/png;base64", Err("invalid_data_url")),
    ];
    for (url, expected) in rows {
        match (ec_core::decode_data_url(url), expected) {
            (Ok(d), Ok((mime, bytes))) => {
                assert_eq!(d.mime_type, *mime, "{url}");
                assert_eq!(d.data, *bytes, "{url}");
            }
            (Err(e), Err(code)) => assert_eq!(e.code(), *code, "{url}"),
            (got, want) => panic!("{url}: got {got:?}, want {want:?}"),
        }
    }
    let h = ec_core::compute_mm_hash(b"hello", "m", None);
    assert_eq!(h, ec_core::compute_mm_hash(b"hello", "m", None));
    assert_ne!(h, ec_core::compute_mm_hash(b"hello", "m2", None));
    assert_ne!(h, ec_core::compute_mm_hash(b"hellp", "m", None));
    // Length framing: moving bytes between model id and data changes the hash.
    assert_ne!(
        ec_core::compute_mm_hash(b"bc", "a", None),
        ec_core::compute_mm_hash(b"c", "ab", None)
    );
    for (value, valid) in [
        ("ab12", true),
        ("AB12", false),
        ("", false),
        ("xyz", false),
        (&"a".repeat(128) as &str, true),
        (&"a".repeat(129), false),
    ] {
        assert_eq!(ec_core::is_valid_mm_hash(value), valid, "{value}");
    }
}

#[test]
fn big_integers_keep_every_digit() {
    let digits = format!("-{}", "987654321".repeat(33));
    let doc = format!(r#"{{"a":[1e19,{digits},18446744073709551616,0.5]}}"#);
    let v = value(&doc);
    let items = match v.get("a") {
        Some(Value::Array(items)) => items.clone(),
        other => panic!("{other:?}"),
    };
    assert!(
        matches!(items[0], Value::Number(ec_core::Number::Float(_))),
        "1e19 stays a float"
    );
    assert_eq!(items[1], Value::BigInt(digits.as_str().into()));
    assert_eq!(items[2], Value::BigInt("18446744073709551616".into()));
    assert_eq!(
        serde_json::to_string(&v).expect("serializes"),
        format!(r#"{{"a":[1e+19,{digits},18446744073709551616,0.5]}}"#)
    );
    let beyond_floats = format!(r#"{{"a":{}}}"#, "9".repeat(400));
    let v = parse_str(&beyond_floats, &Limits::default()).expect("kept exact");
    assert_eq!(v.get("a"), Some(&Value::BigInt("9".repeat(400).into())));
    let too_long = format!(r#"{{"a":{}}}"#, "9".repeat(5000));
    let err = parse_str(&too_long, &Limits::default()).expect_err("over the digit limit");
    assert_eq!(err.code(), "limit_exceeded");
}
