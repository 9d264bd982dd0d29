//! No input makes the parser panic: mutated and truncated bodies all return.

mod common;

use ec_core::{parse_request, Endpoint, Limits};

#[test]
fn mutated_bodies_never_panic() {
    let img = format!("data:image/png;base64,{}", common::PNG_B64);
    let seeds = [
        (Endpoint::Chat, format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"hi"}},{{"type":"image_url","image_url":{{"url":"{img}"}},"uuid":"u1"}}]}}],"temperature":0.5,"stop":["x"],"vllm_xargs":{{"a":[1,2]}},"kv_transfer_params":{{}}}}"#)),
        (Endpoint::Completions, r#"{"prompt":[[1,2],[3]],"max_tokens":4,"logprobs":1,"echo":true}"#.to_string()),
        (Endpoint::Responses, format!(r#"{{"input":[{{"role":"user","content":[{{"type":"input_text","text":"a"}},{{"type":"input_image","image_url":"{img}"}}]}}],"instructions":"i"}}"#)),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3,4],"sampling_params":{"max_tokens":2},"features":{"mm_hashes":["ab"],"mm_placeholders":[{"offset":1,"length":2}],"mm_grid_thw":[[1,1,2]]}}"#.to_string()),
    ];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet = b"{}[]:,\"\\0123456789-.eEtrufalsn \xff\xc3";
    let mut outcomes = [0usize; 2];
    for (endpoint, seed) in &seeds {
        let bytes = seed.as_bytes();
        for cut in 0..bytes.len() {
            let r = parse_request(*endpoint, &bytes[..cut], "", &Limits::default());
            outcomes[usize::from(r.is_ok())] += 1;
        }
        for _ in 0..3000 {
            let mut body = bytes.to_vec();
            for _ in 0..(1 + next() % 4) {
                let at = (next() as usize) % body.len();
                match next() % 3 {
                    0 => body[at] = alphabet[(next() as usize) % alphabet.len()],
                    1 => {
                        body.remove(at);
                    }
                    _ => body.insert(at, alphabet[(next() as usize) % alphabet.len()]),
                }
            }
            let r = parse_request(*endpoint, &body, "", &Limits::default());
            if let Err(e) = &r {
                assert!(!e.message().is_empty());
            }
            outcomes[usize::from(r.is_ok())] += 1;
        }
    }
    assert!(outcomes[0] > 1000 && outcomes[1] > 10, "{outcomes:?}");
}

/// The parser accepts and rejects what serde_json does, and builds the same values.
#[test]
fn json_parser_agrees_with_serde_json() {
    let mut docs: Vec<String> = [
        r#"{"a":[1,-2,3.5e-3,1E+2,-1,0.0,true,false,null,"s"],"b":{"c":{},"d":[]}}"#,
        r#"  [ 1 , [ 2 , [ 3 ] ] ]  "#,
        r#""esc \" \\ \/ \b \f \n \r \t \u0041 \u00e9 \ud83d\ude00""#,
        r#"{"dup":1,"dup":2}"#,
        "18446744073709551615",
        "-9223372036854775808",
        "-9223372036854775809",
        "1.7976931348623157e308",
        "5e-324",
        "123456789012345678901234567890",
        "\"\u{e9}\u{6f22}\u{1F600}\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bad = [
        "",
        " ",
        "{",
        "}",
        "[",
        "[1,]",
        "{\"a\":1,}",
        "{\"a\" 1}",
        "{1:2}",
        "01",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "1e+",
        "--1",
        "tru",
        "nul",
        "[1 2]",
        "\"\\x\"",
        "\"\\u12\"",
        "\"\\ud800\"",
        "\"\\udc00\"",
        "\"\\ud800\\u0041\"",
        "\"a\u{1}b\"",
        "\"open",
        "NaN",
        "-Infinity",
        "1e400",
        "[1]]",
        "{}{}",
        "\"\\",
        "[\"a\"\"b\"]",
    ];
    docs.extend(bad.iter().map(|s| s.to_string()));
    // Truncations and single-byte edits of a rich document.
    let seed = r#"{"m":[{"r":"u","c":[{"t":"x","v":"a\nb"},{"n":-12.5e3}]}],"k":{"ids":[1,2,3],"f":false,"z":null}}"#;
    for cut in 0..seed.len() {
        docs.push(seed[..cut].to_string());
    }
    for (i, _) in seed.char_indices() {
        for b in ["\"", "]", "}", ",", ":", "1", "e", "-", " ", "\\", "x"] {
            let mut d = seed.to_string();
            d.replace_range(i..i + 1, b);
            docs.push(d);
        }
    }
    let limits = Limits::default();
    let mut checked = [0usize; 2];
    for doc in &docs {
        let ours = ec_core::parse_str(doc, &limits);
        let theirs = serde_json::from_str::<serde_json::Value>(doc);
        assert_eq!(
            ours.is_ok(),
            theirs.is_ok(),
            "{doc:?}: ours {ours:?}, serde_json {theirs:?}"
        );
        if let (Ok(ours), Ok(theirs)) = (ours, theirs) {
            let ours_json = serde_json::to_string(&ours).expect("serializes");
            let again: serde_json::Value = serde_json::from_str(&ours_json).expect("valid");
            assert_eq!(again, theirs, "{doc:?}");
            checked[1] += 1;
        } else {
            checked[0] += 1;
        }
    }
    assert!(checked[0] > 100 && checked[1] > 20, "{checked:?}");
    // Where the two differ on purpose: -0 is the integer 0 (as Python's json reads it).
    assert_eq!(
        ec_core::parse_str("-0", &limits),
        Ok(ec_core::Value::Number(ec_core::Number::Int(0)))
    );
}

/// Many unknown keys cost linear time and a bounded list.
#[test]
fn many_unknown_fields_are_cheap() {
    let mut body = String::from(r#"{"messages":[{"role":"user","content":"hi"}]"#);
    for i in 0..200_000 {
        body.push_str(&format!(r#","k{i}":{i}"#));
    }
    body.push('}');
    let started = std::time::Instant::now();
    let r = parse_request(Endpoint::Chat, body.as_bytes(), "", &Limits::default()).expect("valid");
    assert_eq!(r.unknown_fields.len(), 64);
    assert_eq!(r.unknown_fields[0], "k0");
    assert!(
        started.elapsed().as_secs_f64() < 5.0,
        "{:?}",
        started.elapsed()
    );
}
