//! vLLM's request conventions: pydantic's lax coercion of numbers and booleans, and
//! every field vLLM applies either applied here or refused with a 400 naming it.

mod common;

use common::{json, ok, parse};
use ec_core::Endpoint;
use serde_json::json;

const MSG: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

fn chat(extra: &str) -> String {
    format!("{{{MSG},{extra}}}")
}

/// Each row: a field's JSON value, where it lands in the parsed request and the value
/// expected there (`None`: refused with `invalid_type` or `out_of_range` naming the field).
/// The expectations are pydantic 2's lax-mode results, as vLLM 0.33 validates.
#[test]
fn numbers_and_booleans_coerce_as_pydantic_lax_mode() {
    #[rustfmt::skip]
    let rows: Vec<(&str, &str, &str, Option<serde_json::Value>)> = vec![
        // int fields
        ("max_tokens", r#""16""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", r#"" 16 ""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", r#""+16""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", r#""1_6""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", r#""16.0""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", r#""16.00""#, "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", "16.0", "/sampling/max_tokens", Some(json!(16))),
        ("max_tokens", "true", "/sampling/max_tokens", Some(json!(1))),
        ("max_tokens", r#""16.5""#, "", None),
        ("max_tokens", "16.5", "", None),
        ("max_tokens", r#""16.""#, "", None),
        ("max_tokens", r#""1e3""#, "", None),
        ("max_tokens", r#""0x10""#, "", None),
        ("max_tokens", r#""1__6""#, "", None),
        ("max_tokens", r#""_16""#, "", None),
        ("max_tokens", r#""16_""#, "", None),
        ("max_tokens", r#""+-1""#, "", None),
        ("max_tokens", r#""""#, "", None),
        ("max_tokens", r#""sixteen""#, "", None),
        ("max_tokens", r#""99999999999999999999""#, "", None),
        ("max_tokens", "false", "", None),
        ("n", "true", "/sampling/n", Some(json!(1))),
        ("n", r#""2""#, "/sampling/n", Some(json!(2))),
        ("seed", r#""-3""#, "/sampling/seed", Some(json!(-3))),
        ("top_k", r#""-1""#, "/sampling/top_k", Some(json!(0))),
        ("stop_token_ids", r#"["7", 8.0, true]"#, "/sampling/stop_token_ids", Some(json!([7, 8, 1]))),
        // float fields
        ("temperature", r#""0.5""#, "/sampling/temperature", Some(json!(0.5))),
        ("temperature", r#"" 0.5""#, "/sampling/temperature", Some(json!(0.5))),
        ("temperature", r#"".5""#, "/sampling/temperature", Some(json!(0.5))),
        ("temperature", r#""1.""#, "/sampling/temperature", Some(json!(1.0))),
        ("temperature", r#""5e-1""#, "/sampling/temperature", Some(json!(0.5))),
        ("temperature", "true", "/sampling/temperature", Some(json!(1.0))),
        ("temperature", "false", "/sampling/temperature", Some(json!(0.0))),
        ("top_p", r#""0_5e-1""#, "/sampling/top_p", Some(json!(0.5))),
        ("temperature", r#""hot""#, "", None),
        ("temperature", r#""1e""#, "", None),
        ("temperature", r#""0x1p3""#, "", None),
        ("temperature", r#""nan""#, "", None),
        ("temperature", r#""inf""#, "", None),
        ("temperature", r#"" ""#, "", None),
        // bool fields
        ("stream", "1", "/stream", Some(json!(true))),
        ("stream", "0", "/stream", Some(json!(false))),
        ("stream", "1.0", "/stream", Some(json!(true))),
        ("stream", r#""true""#, "/stream", Some(json!(true))),
        ("stream", r#""TRUE""#, "/stream", Some(json!(true))),
        ("stream", r#""Yes""#, "/stream", Some(json!(true))),
        ("stream", r#""on""#, "/stream", Some(json!(true))),
        ("stream", r#""t""#, "/stream", Some(json!(true))),
        ("stream", r#""y""#, "/stream", Some(json!(true))),
        ("stream", r#""1""#, "/stream", Some(json!(true))),
        ("stream", r#""false""#, "/stream", Some(json!(false))),
        ("stream", r#""OFF""#, "/stream", Some(json!(false))),
        ("stream", r#""no""#, "/stream", Some(json!(false))),
        ("stream", r#""n""#, "/stream", Some(json!(false))),
        ("stream", r#""f""#, "/stream", Some(json!(false))),
        ("stream", r#""0""#, "/stream", Some(json!(false))),
        ("stream", "2", "", None),
        ("stream", "0.5", "", None),
        ("stream", r#""2""#, "", None),
        ("stream", r#"" true""#, "", None),
        ("stream", r#""truee""#, "", None),
        ("stream", r#""""#, "", None),
        ("ignore_eos", r#""yes""#, "/sampling/ignore_eos", Some(json!(true))),
        ("skip_special_tokens", "0", "/sampling/skip_special_tokens", Some(json!(false))),
        ("logprobs", r#""true""#, "/sampling/logprobs", Some(json!(0))),
        ("logprobs", "3", "", None),
    ];
    for (field, value, pointer, expected) in rows {
        let body = chat(&format!(r#""{field}":{value}"#));
        match expected {
            Some(want) => {
                let got = json(&ok(Endpoint::Chat, &body));
                assert_eq!(got.pointer(pointer), Some(&want), "{body}");
            }
            None => {
                let err = parse(Endpoint::Chat, &body).expect_err(&body);
                assert!(
                    matches!(err.code(), "invalid_type" | "out_of_range"),
                    "{body}: {err:?}"
                );
                assert_eq!(err.param(), Some(field), "{body}");
            }
        }
    }
}

#[test]
fn coercion_applies_on_every_endpoint() {
    let p = json(&ok(
        Endpoint::Completions,
        r#"{"prompt":"x","logprobs":true,"echo":"1","max_tokens":"3"}"#,
    ));
    assert_eq!(p["sampling"]["logprobs"], json!(1));
    assert_eq!(p["sampling"]["max_tokens"], json!(3));
    assert_eq!(p["echo"], json!(true));
    let p = json(&ok(
        Endpoint::Responses,
        r#"{"input":"x","max_output_tokens":"5","top_logprobs":"2","stream":"on","include":["message.output_text.logprobs"]}"#,
    ));
    assert_eq!(p["sampling"]["max_tokens"], json!(5));
    assert_eq!(p["sampling"]["logprobs"], json!(2));
    assert_eq!(p["stream"], json!(true));
    let p = json(&ok(
        Endpoint::Generate,
        r#"{"token_ids":["1",2],"sampling_params":{"temperature":"0","max_tokens":"4"}}"#,
    ));
    assert_eq!(p["token_ids"], json!([1, 2]));
    assert_eq!(p["sampling"]["max_tokens"], json!(4));
    let p = json(&ok(
        Endpoint::Chat,
        &chat(r#""stream":"true","stream_options":{"include_usage":"yes"}"#),
    ));
    assert_eq!(p["include_usage"], json!(true));
}

/// Fields vLLM 0.33 applies and this server does not: a value that changes nothing
/// passes, any other is a 400 naming the field.
#[test]
fn unapplied_vllm_fields_are_refused_by_name() {
    #[rustfmt::skip]
    let refused: Vec<(Endpoint, &str, &str)> = vec![
        (Endpoint::Chat, "use_beam_search", "true"),
        (Endpoint::Chat, "priority", "5"),
        (Endpoint::Responses, "priority", "-1"),
        (Endpoint::Chat, "chat_template", r#""{{ messages }}""#),
        (Endpoint::Chat, "spaces_between_special_tokens", "false"),
        (Endpoint::Completions, "add_special_tokens", "false"),
        (Endpoint::Chat, "add_special_tokens", "true"),
        (Endpoint::Completions, "suffix", r#""end""#),
        (Endpoint::Responses, "previous_response_id", r#""resp_1""#),
        (Endpoint::Responses, "background", "true"),
        (Endpoint::Responses, "reasoning", r#"{"effort":"low"}"#),
        (Endpoint::Responses, "truncation", r#""auto""#),
        (Endpoint::Chat, "reasoning_effort", r#""low""#),
        (Endpoint::Chat, "mm_payload", r#""none""#),
    ];
    #[rustfmt::skip]
    let harmless: Vec<(Endpoint, &str, &str)> = vec![
        (Endpoint::Chat, "response_format", r#"{"type":"text"}"#),
        (Endpoint::Chat, "response_format", "null"),
        (Endpoint::Responses, "text", r#"{"format":{"type":"text"}}"#),
        (Endpoint::Chat, "tool_choice", r#""none""#),
        (Endpoint::Responses, "tool_choice", r#""auto""#),
        (Endpoint::Chat, "bad_words", "[]"),
        (Endpoint::Responses, "max_tool_calls", "null"),
        (Endpoint::Chat, "continue_final_message", "false"),
        (Endpoint::Chat, "priority", "0"),
        (Endpoint::Chat, "return_token_ids", "false"),
        (Endpoint::Chat, "stream_interval", "1"),
        (Endpoint::Chat, "spaces_between_special_tokens", "true"),
        (Endpoint::Completions, "add_special_tokens", "true"),
        (Endpoint::Chat, "add_special_tokens", "false"),
        (Endpoint::Responses, "truncation", r#""disabled""#),
        (Endpoint::Responses, "store", "true"),
        (Endpoint::Chat, "some_field_vllm_does_not_know", r#"{"a":1}"#),
        // A field refused on one endpoint is not looked at on another that lacks it.
        (Endpoint::Chat, "suffix", r#""end""#),
    ];
    let body = |endpoint: Endpoint, field: &str, value: &str| match endpoint {
        Endpoint::Chat => chat(&format!(r#""{field}":{value}"#)),
        Endpoint::Completions => format!(r#"{{"prompt":"x","{field}":{value}}}"#),
        _ => format!(r#"{{"input":"x","{field}":{value}}}"#),
    };
    for (endpoint, field, value) in refused {
        let b = body(endpoint, field, value);
        let err = parse(endpoint, &b).expect_err(&b);
        assert_eq!(err.code(), "invalid_value", "{b}");
        assert_eq!(err.param(), Some(field), "{b}");
        assert!(err.message().contains("not supported"), "{b}: {err:?}");
    }
    for (endpoint, field, value) in harmless {
        let b = body(endpoint, field, value);
        ok(endpoint, &b);
    }
}

#[test]
fn logit_bias_allowed_token_ids_and_min_tokens_are_read_as_vllm_reads_them() {
    #[rustfmt::skip]
    let rows: Vec<(Endpoint, String, &str, serde_json::Value)> = vec![
        (Endpoint::Chat, chat(r#""logit_bias":{"5":10," 7 ":"-3.5","1_0":true,"8":250,"9":-1e9}"#), "/sampling/logit_bias", json!([[5, 10.0], [7, -3.5], [10, 1.0], [8, 100.0], [9, -100.0]])),
        (Endpoint::Chat, chat(r#""logit_bias":{}"#), "/sampling/logit_bias", json!([])),
        (Endpoint::Chat, chat(r#""logit_bias":null"#), "/sampling/logit_bias", json!(null)),
        (Endpoint::Completions, r#"{"prompt":"x","logit_bias":{"+3":1}}"#.into(), "/sampling/logit_bias", json!([[3, 1.0]])),
        (Endpoint::Responses, r#"{"input":"x","logit_bias":{"3":1}}"#.into(), "/sampling/logit_bias", json!([[3, 1.0]])),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"logit_bias":{"3":1},"allowed_token_ids":[4]}}"#.into(), "/sampling/allowed_token_ids", json!([4])),
        (Endpoint::Chat, chat(r#""allowed_token_ids":["3",4.0,true]"#), "/sampling/allowed_token_ids", json!([3, 4, 1])),
        (Endpoint::Chat, chat(r#""min_tokens":"3""#), "/sampling/min_tokens", json!(3)),
        (Endpoint::Chat, chat(r#""min_tokens":5,"max_tokens":5"#), "/sampling/min_tokens", json!(5)),
        (Endpoint::Completions, r#"{"prompt":"x","min_tokens":16}"#.into(), "/sampling/min_tokens", json!(16)),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"min_tokens":2}}"#.into(), "/sampling/min_tokens", json!(2)),
        (Endpoint::Completions, r#"{"prompt":"x","allowed_token_ids":[2]}"#.into(), "/sampling/allowed_token_ids", json!([2])),
    ];
    for (endpoint, body, pointer, want) in rows {
        let got = json(&ok(endpoint, &body));
        assert_eq!(got.pointer(pointer), Some(&want), "{body}");
    }
    #[rustfmt::skip]
    let refused: Vec<(Endpoint, String, &str)> = vec![
        (Endpoint::Chat, chat(r#""logit_bias":{"x":1}"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""logit_bias":{"5.0":1}"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""logit_bias":{"1__0":1}"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""logit_bias":{"-1":1}"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""logit_bias":{"99999999999":1}"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""logit_bias":{"5":"much"}"#), "logit_bias.5"),
        (Endpoint::Chat, chat(r#""logit_bias":[1]"#), "logit_bias"),
        (Endpoint::Chat, chat(r#""allowed_token_ids":[]"#), "allowed_token_ids"),
        (Endpoint::Chat, chat(r#""allowed_token_ids":[-1]"#), "allowed_token_ids[0]"),
        (Endpoint::Chat, chat(r#""allowed_token_ids":3"#), "allowed_token_ids"),
        (Endpoint::Chat, chat(r#""min_tokens":-1"#), "min_tokens"),
        (Endpoint::Chat, chat(r#""min_tokens":6,"max_completion_tokens":5"#), "min_tokens"),
        (Endpoint::Completions, r#"{"prompt":"x","min_tokens":17}"#.into(), "min_tokens"),
    ];
    for (endpoint, body, param) in refused {
        let err = parse(endpoint, &body).expect_err(&body);
        assert_eq!(err.param(), Some(param), "{body}: {err:?}");
    }
}
