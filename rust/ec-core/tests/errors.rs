//! Every rejection with its code and parameter path.

mod common;

use common::{parse, PNG_B64};
use ec_core::{parse_request, Endpoint, Limits};

const CHAT_OK: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

fn chat(extra: &str) -> String {
    format!("{{{CHAT_OK},{extra}}}")
}

fn image(url: &str) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":"a"}},{{"role":"assistant","content":"b"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
    )
}

#[test]
fn errors_name_code_and_param() {
    let url_param = Some("messages[2].content[0].image_url.url");
    // (endpoint, body, code, param)
    let rows: Vec<(Endpoint, String, &str, Option<&str>)> = vec![
        (Endpoint::Chat, String::new(), "invalid_json", None),
        (Endpoint::Chat, "   ".into(), "invalid_json", None),
        (Endpoint::Chat, r#"{"messages": [{"role": "user""#.into(), "invalid_json", None),
        (Endpoint::Chat, r#"{"messages": []"#.into(), "invalid_json", None),
        (Endpoint::Chat, r#"{"messages": [], }"#.into(), "invalid_json", None),
        (Endpoint::Chat, r#"{'messages': []}"#.into(), "invalid_json", None),
        (Endpoint::Chat, chat(r#""temperature": NaN"#), "invalid_json", None),
        (Endpoint::Chat, chat(r#""temperature": -Infinity"#), "invalid_json", None),
        (Endpoint::Chat, chat(r#""temperature": 1e999"#), "invalid_json", None),
        (Endpoint::Chat, format!("{{{CHAT_OK}}} trailing"), "invalid_json", None),
        (Endpoint::Chat, "[1,2]".into(), "invalid_type", None),
        (Endpoint::Chat, "\"just a string\"".into(), "invalid_type", None),
        (Endpoint::Chat, "{}".into(), "missing_field", Some("messages")),
        (Endpoint::Chat, r#"{"messages":null}"#.into(), "missing_field", Some("messages")),
        (Endpoint::Chat, r#"{"messages":[]}"#.into(), "invalid_value", Some("messages")),
        (Endpoint::Chat, r#"{"messages":"hi"}"#.into(), "invalid_type", Some("messages")),
        (Endpoint::Chat, r#"{"messages":[1]}"#.into(), "invalid_type", Some("messages[0]")),
        (Endpoint::Chat, r#"{"messages":[{"content":"hi"}]}"#.into(), "missing_field", Some("messages[0].role")),
        (Endpoint::Chat, r#"{"messages":[{"role":"wizard","content":"hi"}]}"#.into(), "invalid_value", Some("messages[0].role")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user"}]}"#.into(), "missing_field", Some("messages[0].content")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":5}]}"#.into(), "invalid_type", Some("messages[0].content")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"text":"x"}]}]}"#.into(), "missing_field", Some("messages[0].content[0].type")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"video","text":"x"}]}]}"#.into(), "invalid_value", Some("messages[0].content[0].type")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"text","text":3}]}]}"#.into(), "invalid_type", Some("messages[0].content[0].text")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#.into(), "missing_field", Some("messages[0].content[0].image_url")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#.into(), "missing_field", Some("messages[0].content[0].image_url.url")),
        (Endpoint::Chat, image("data:image/png;base64,!!!notbase64!!!"), "invalid_base64", url_param),
        (Endpoint::Chat, image("data:image/png;base64,"), "invalid_data_url", url_param),
        (Endpoint::Chat, image("data:image/png,rawbytes"), "invalid_data_url", url_param),
        (Endpoint::Chat, image("data:image/png;base64"), "invalid_data_url", url_param),
        (Endpoint::Chat, image(&format!("data:text/plain;base64,{PNG_B64}")), "invalid_data_url", url_param),
        (Endpoint::Chat, image("ftp://example.com/a.png"), "invalid_value", url_param),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"},"uuid":7}]}]}"#.into(), "invalid_type", Some("messages[0].content[0].uuid")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"},"uuid":""}]}]}"#.into(), "invalid_value", Some("messages[0].content[0].uuid")),
        (Endpoint::Chat, chat(r#""model":5"#), "invalid_type", Some("model")),
        (Endpoint::Chat, chat(r#""echo":true"#), "invalid_value", Some("echo")),
        (Endpoint::Chat, chat(r#""echo":"yes","logprobs":true"#), "invalid_value", Some("echo")),
        (Endpoint::Chat, chat(r#""stop":["a","b","c","d","e"]"#), "invalid_value", Some("stop")),
        (Endpoint::Completions, r#"{"prompt":"x","stop":["a","b","c","d","e"]}"#.into(), "invalid_value", Some("stop")),
        (Endpoint::Responses, r#"{"input":"x","stop":["a","b","c","d","e"]}"#.into(), "invalid_value", Some("stop")),
        (Endpoint::Chat, chat(r#""stream":true,"stream_options":{"continuous_usage_stats":2}"#), "invalid_type", Some("stream_options.continuous_usage_stats")),
        (Endpoint::Chat, chat(r#""stream_interval":0"#), "out_of_range", Some("stream_interval")),
        (Endpoint::Chat, chat(r#""return_token_ids":"maybe""#), "invalid_type", Some("return_token_ids")),
        (Endpoint::Chat, chat(r#""continue_final_message":true"#), "invalid_value", Some("continue_final_message")),
        (Endpoint::Chat, chat(r#""continue_final_message":"yes","add_generation_prompt":true"#), "invalid_value", Some("continue_final_message")),
        (Endpoint::Chat, chat(r#""truncate_prompt_tokens":-2"#), "out_of_range", Some("truncate_prompt_tokens")),
        (Endpoint::Completions, r#"{"prompt":"x","truncation_side":"middle"}"#.into(), "invalid_value", Some("truncation_side")),
        (Endpoint::Completions, r#"{"prompt":"x","bad_words":["a",""]}"#.into(), "invalid_value", Some("bad_words")),
        (Endpoint::Completions, r#"{"prompt":"x","bad_words":"a"}"#.into(), "invalid_type", Some("bad_words")),
        (Endpoint::Completions, r#"{"prompt":"x","bad_words":[1]}"#.into(), "invalid_type", Some("bad_words[0]")),
        (Endpoint::Responses, r#"{"input":"x","include":["reasoning.encrypted_content"]}"#.into(), "invalid_value", Some("include")),
        (Endpoint::Responses, r#"{"input":"x","include":["everything"]}"#.into(), "invalid_value", Some("include[0]")),
        (Endpoint::Responses, r#"{"input":"x","include":"message.output_text.logprobs"}"#.into(), "invalid_type", Some("include")),
        (Endpoint::Chat, chat(r#""max_tokens":0"#), "out_of_range", Some("max_tokens")),
        (Endpoint::Chat, chat(r#""max_tokens":-5"#), "out_of_range", Some("max_tokens")),
        (Endpoint::Chat, chat(r#""max_tokens":"10.5""#), "invalid_type", Some("max_tokens")),
        (Endpoint::Chat, chat(r#""max_tokens":1.5"#), "invalid_type", Some("max_tokens")),
        (Endpoint::Chat, chat(r#""max_tokens":123456789012345678901234567890"#), "out_of_range", Some("max_tokens")),
        (Endpoint::Chat, chat(r#""max_completion_tokens":0"#), "out_of_range", Some("max_completion_tokens")),
        (Endpoint::Chat, chat(r#""temperature":2.5"#), "out_of_range", Some("temperature")),
        (Endpoint::Chat, chat(r#""temperature":-0.1"#), "out_of_range", Some("temperature")),
        (Endpoint::Chat, chat(r#""temperature":"hot""#), "invalid_type", Some("temperature")),
        (Endpoint::Chat, chat(r#""top_p":0"#), "out_of_range", Some("top_p")),
        (Endpoint::Chat, chat(r#""top_p":1.01"#), "out_of_range", Some("top_p")),
        (Endpoint::Chat, chat(r#""top_k":-2"#), "out_of_range", Some("top_k")),
        (Endpoint::Chat, chat(r#""min_p":1.5"#), "out_of_range", Some("min_p")),
        (Endpoint::Chat, chat(r#""n":0"#), "out_of_range", Some("n")),
        (Endpoint::Chat, chat(r#""presence_penalty":3"#), "out_of_range", Some("presence_penalty")),
        (Endpoint::Chat, chat(r#""frequency_penalty":-3"#), "out_of_range", Some("frequency_penalty")),
        (Endpoint::Chat, chat(r#""repetition_penalty":0"#), "out_of_range", Some("repetition_penalty")),
        (Endpoint::Chat, chat(r#""top_logprobs":21,"logprobs":true"#), "out_of_range", Some("top_logprobs")),
        (Endpoint::Chat, chat(r#""top_logprobs":-1,"logprobs":true"#), "out_of_range", Some("top_logprobs")),
        (Endpoint::Chat, chat(r#""top_logprobs":3"#), "invalid_value", Some("top_logprobs")),
        (Endpoint::Chat, chat(r#""logprobs":3"#), "invalid_type", Some("logprobs")),
        (Endpoint::Chat, chat(r#""seed":9223372036854775808"#), "out_of_range", Some("seed")),
        (Endpoint::Chat, chat(r#""stop":[1]"#), "invalid_type", Some("stop[0]")),
        (Endpoint::Chat, chat(r#""stop":5"#), "invalid_type", Some("stop")),
        (Endpoint::Chat, chat(r#""stop_token_ids":[1,-1]"#), "out_of_range", Some("stop_token_ids[1]")),
        (Endpoint::Chat, chat(r#""stream":"maybe""#), "invalid_type", Some("stream")),
        (Endpoint::Chat, chat(r#""stream_options":{"include_usage":true}"#), "invalid_value", Some("stream_options")),
        (Endpoint::Chat, chat(r#""stream":true,"stream_options":{"include_usage":2}"#), "invalid_type", Some("stream_options.include_usage")),
        (Endpoint::Chat, chat(r#""stream":true,"prompt_logprobs":2"#), "invalid_value", Some("prompt_logprobs")),
        (Endpoint::Chat, chat(r#""kv_transfer_params":[1]"#), "invalid_type", Some("kv_transfer_params")),
        (Endpoint::Chat, chat(r#""ec_transfer_params":"x""#), "invalid_type", Some("ec_transfer_params")),
        (Endpoint::Chat, chat(r#""vllm_xargs":3"#), "invalid_type", Some("vllm_xargs")),
        (Endpoint::Chat, chat(r#""mm_processor_kwargs":[]"#), "invalid_type", Some("mm_processor_kwargs")),
        (Endpoint::Completions, "{}".into(), "missing_field", Some("prompt")),
        (Endpoint::Completions, r#"{"prompt":[]}"#.into(), "invalid_value", Some("prompt")),
        (Endpoint::Completions, r#"{"prompt":["a",1]}"#.into(), "invalid_type", Some("prompt[1]")),
        (Endpoint::Completions, r#"{"prompt":[1,"a"]}"#.into(), "invalid_type", Some("prompt[1]")),
        (Endpoint::Completions, r#"{"prompt":[[1],[]]}"#.into(), "invalid_value", Some("prompt[1]")),
        (Endpoint::Completions, r#"{"prompt":[[1],[2,-3]]}"#.into(), "out_of_range", Some("prompt[1][1]")),
        (Endpoint::Completions, r#"{"prompt":{"a":1}}"#.into(), "invalid_type", Some("prompt")),
        (Endpoint::Completions, r#"{"prompt":"x","logprobs":"all"}"#.into(), "invalid_type", Some("logprobs")),
        (Endpoint::Completions, r#"{"prompt":"x","logprobs":21}"#.into(), "out_of_range", Some("logprobs")),
        (Endpoint::Responses, "{}".into(), "missing_field", Some("input")),
        (Endpoint::Responses, r#"{"input":[]}"#.into(), "invalid_value", Some("input")),
        (Endpoint::Responses, r#"{"input":5}"#.into(), "invalid_type", Some("input")),
        (Endpoint::Responses, r#"{"input":[{"type":"function_call","role":"user","content":"x"}]}"#.into(), "invalid_value", Some("input[0].type")),
        (Endpoint::Responses, r#"{"input":[{"role":"user","content":[{"type":"input_file"}]}]}"#.into(), "invalid_value", Some("input[0].content[0].type")),
        (Endpoint::Responses, r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":{"url":"https://x"}}]}]}"#.into(), "invalid_type", Some("input[0].content[0].image_url")),
        (Endpoint::Responses, r#"{"input":"x","max_output_tokens":0}"#.into(), "out_of_range", Some("max_output_tokens")),
        (Endpoint::Responses, r#"{"input":"x","instructions":1}"#.into(), "invalid_type", Some("instructions")),
        (Endpoint::Generate, "{}".into(), "missing_field", Some("token_ids")),
        (Endpoint::Generate, r#"{"token_ids":[]}"#.into(), "invalid_value", Some("token_ids")),
        (Endpoint::Generate, r#"{"token_ids":[1,"two"]}"#.into(), "invalid_type", Some("token_ids[1]")),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":[]}"#.into(), "invalid_type", Some("sampling_params")),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"n":2}}"#.into(), "invalid_value", Some("sampling_params.n")),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"temperature":9}}"#.into(), "out_of_range", Some("sampling_params.temperature")),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"extra_args":1}}"#.into(), "invalid_type", Some("sampling_params.extra_args")),
        (Endpoint::Generate, r#"{"token_ids":[1],"request_id":7}"#.into(), "invalid_type", Some("request_id")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":["AB"],"mm_placeholders":[{"offset":0,"length":1}]}}"#.into(), "invalid_value", Some("features.mm_hashes[0]")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":["ab"],"mm_placeholders":[]}}"#.into(), "invalid_value", Some("features.mm_placeholders")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":["ab"],"mm_placeholders":[{"offset":1,"length":5}]}}"#.into(), "invalid_value", Some("features.mm_placeholders[0]")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":["ab"],"mm_placeholders":[{"offset":0}]}}"#.into(), "missing_field", Some("features.mm_placeholders[0].length")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":["ab"],"mm_placeholders":[{"offset":0,"length":1}],"mm_grid_thw":[[1,2]]}}"#.into(), "invalid_value", Some("features.mm_grid_thw[0]")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_placeholders":[]}}"#.into(), "missing_field", Some("features.mm_hashes")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"output_mode":"derender"}"#.into(), "invalid_value", Some("output_mode")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"output_mode":"json"}"#.into(), "invalid_value", Some("output_mode")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"priority":1}"#.into(), "invalid_value", Some("priority")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"audio":["ab"]},"mm_placeholders":{"audio":[{"offset":0,"length":1}]}}}"#.into(), "invalid_value", Some("features.mm_hashes.audio")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{}}}"#.into(), "invalid_value", Some("features.mm_placeholders")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{"image":[]}}}"#.into(), "invalid_value", Some("features.mm_placeholders.image")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{"image":[{"offset":1,"length":2}]}}}"#.into(), "invalid_value", Some("features.mm_placeholders.image[0]")),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"features":{"mm_hashes":{"image":["ab","cd"]},"mm_placeholders":{"image":[{"offset":0,"length":2},{"offset":1,"length":1}]}}}"#.into(), "invalid_value", Some("features.mm_placeholders")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{"image":[{"offset":0,"length":1}]},"kwargs_data":{"image":["AAAA"]}}}"#.into(), "invalid_value", Some("features.kwargs_data.image[0]")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{"image":[{"offset":0,"length":1}]},"mm_metadata":{}}}"#.into(), "invalid_value", Some("features.mm_metadata")),
        (Endpoint::Generate, r#"{"token_ids":[1,2],"features":{"mm_hashes":{"image":["ab"]},"mm_placeholders":{"image":[{"offset":0,"length":1}]},"mm_grid_thw":{"image":[]}}}"#.into(), "invalid_value", Some("features.mm_grid_thw.image")),
    ];
    for (endpoint, body, code, param) in rows {
        let err = parse(endpoint, &body).expect_err(&body);
        assert_eq!(err.code(), code, "{body}: {err:?}");
        assert_eq!(err.param(), param, "{body}: {err:?}");
        assert!(!err.message().is_empty());
    }
}

#[test]
fn invalid_utf8_is_typed() {
    let mut body = br#"{"messages":[{"role":"user","content":"caf"#.to_vec();
    body.extend_from_slice(&[0xC3, 0x28]);
    body.extend_from_slice(br#""}]}"#);
    let err =
        parse_request(Endpoint::Chat, &body, "", &Limits::default()).expect_err("invalid utf-8");
    assert_eq!(err.code(), "invalid_utf8");
    assert_eq!(err.param(), None);
}

#[test]
fn nan_and_infinity_say_so() {
    for lit in ["NaN", "Infinity", "-Infinity"] {
        let err = parse(Endpoint::Chat, &chat(&format!(r#""top_p": {lit}"#))).expect_err(lit);
        assert!(err.message().contains("NaN and Infinity"), "{lit}: {err}");
    }
}

#[test]
fn limits_are_enforced_with_params() {
    let img = format!("data:image/png;base64,{PNG_B64}");
    let two_images = format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{img}"}}}},{{"type":"image_url","image_url":{{"url":"{img}"}}}}]}}]}}"#
    );
    let nested = |depth: usize| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"vllm_xargs":{{"a":{}1{}}}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        )
    };
    let base = Limits::default();
    // (limits, body, param)
    let rows: Vec<(Limits, String, Option<&str>)> = vec![
        (
            Limits {
                max_body_bytes: 10,
                ..base
            },
            chat(r#""n":1"#),
            None,
        ),
        (
            Limits {
                max_messages: 1,
                ..base
            },
            r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#.into(),
            Some("messages"),
        ),
        (
            Limits {
                max_media_items: 1,
                ..base
            },
            two_images.clone(),
            Some("messages[0].content[1].image_url"),
        ),
        (
            Limits {
                max_media_bytes: 100,
                ..base
            },
            two_images.clone(),
            Some("messages[0].content[1].image_url.url"),
        ),
        (
            Limits {
                max_media_bytes: 10,
                ..base
            },
            two_images,
            Some("messages[0].content[0].image_url.url"),
        ),
        (
            Limits {
                max_string_bytes: 4,
                ..base
            },
            r#"{"messages":[{"role":"user","content":"hello"}]}"#.into(),
            None,
        ),
        (
            Limits {
                max_token_ids: 2,
                ..base
            },
            r#"{"token_ids":[1,2,3]}"#.into(),
            Some("token_ids"),
        ),
        (
            Limits {
                max_depth: 8,
                ..base
            },
            nested(8),
            None,
        ),
        (base, nested(200), None),
        (base, nested(10_000), None),
        (
            base,
            format!(
                r#"{{"messages":{}{}}}"#,
                "{\"a\":".repeat(10_000),
                "}".repeat(10_000)
            ),
            None,
        ),
    ];
    for (limits, body, param) in rows {
        let endpoint = if body.contains("token_ids") {
            Endpoint::Generate
        } else {
            Endpoint::Chat
        };
        let err = parse_request(endpoint, body.as_bytes(), "", &limits)
            .expect_err(&body[..body.len().min(80)]);
        assert_eq!(err.code(), "limit_exceeded", "{err:?}");
        assert_eq!(err.param(), param, "{err:?}");
    }
    // Just inside the depth limit parses.
    let ok = parse_request(
        Endpoint::Chat,
        nested(6).as_bytes(),
        "",
        &Limits {
            max_depth: 8,
            ..base
        },
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn unknown_endpoint() {
    let err = Endpoint::from_name("/v1/embeddings").expect_err("unknown");
    assert_eq!(err.code(), "unknown_endpoint");
    for name in [
        "chat",
        "/v1/chat/completions",
        "completions",
        "/v1/completions",
        "responses",
        "/v1/responses",
        "generate",
        "/inference/v1/generate",
    ] {
        assert!(Endpoint::from_name(name).is_ok(), "{name}");
    }
}
