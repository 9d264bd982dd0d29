//! Valid requests of every endpoint: each row is a body and checks on the result.

mod common;

use common::{json, ok, PNG_B64};
use ec_core::{Endpoint, Part, Prompt, Role};
use serde_json::json;

#[test]
fn valid_requests_normalize_as_expected() {
    let img = format!("data:image/png;base64,{PNG_B64}");
    // (endpoint, body, JSON pointer into the parsed request, expected value)
    let rows: Vec<(Endpoint, String, &str, serde_json::Value)> = vec![
        (Endpoint::Chat, r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.into(), "/sampling/max_tokens", json!(null)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}]}"#.into(), "/model", json!(null)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":7,"max_completion_tokens":9}"#.into(), "/sampling/max_tokens", json!(9)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":7}"#.into(), "/sampling/max_tokens", json!(7)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":7.0}"#.into(), "/sampling/max_tokens", json!(7)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"temperature":null}"#.into(), "/sampling/temperature", json!(1.0)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0}"#.into(), "/sampling/temperature", json!(0.0)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"top_k":-1}"#.into(), "/sampling/top_k", json!(0)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0,"top_k":5,"top_p":0.5,"min_p":0.2}"#.into(), "/sampling", json!({"max_tokens": null, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null, "stop": [], "stop_token_ids": [], "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logprobs": null, "prompt_logprobs": null, "ignore_eos": false, "skip_special_tokens": true, "include_stop_str_in_output": false, "logit_bias": null, "allowed_token_ids": null, "min_tokens": 0, "bad_words": [], "extra_args": null})),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"top_k":40}"#.into(), "/sampling/top_k", json!(40)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"stop":"END"}"#.into(), "/sampling/stop", json!(["END"])),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"stop":["a","b"]}"#.into(), "/sampling/stop", json!(["a", "b"])),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":5}"#.into(), "/sampling/logprobs", json!(5)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true}"#.into(), "/sampling/logprobs", json!(0)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":false,"top_logprobs":0}"#.into(), "/sampling/logprobs", json!(null)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"seed":-9223372036854775808}"#.into(), "/sampling/seed", json!(i64::MIN)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#.into(), "/include_usage", json!(true)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"n":3}"#.into(), "/sampling/n", json!(3)),
        (Endpoint::Chat, r#"{"messages":[{"role":"developer","content":"be brief"},{"role":"user","content":"hi"}]}"#.into(), "/messages/0/role", json!("system")),
        (Endpoint::Chat, r#"{"messages":[{"role":"assistant","content":null},{"role":"user","content":"hi"}]}"#.into(), "/messages/0/content", json!([])),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"surprise":{"x":1},"also_unknown":[]}"#.into(), "/unknown_fields", json!(["surprise", "also_unknown"])),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"prompt":"x"}"#.into(), "/unknown_fields", json!(["prompt"])),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}"#.into(), "/chat_template_kwargs", json!({"enable_thinking": false})),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#.into(), "/add_generation_prompt", json!(false)),
        (Endpoint::Chat, format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what?"}},{{"type":"image_url","image_url":{{"url":"{img}"}}}}]}}]}}"#), "/messages/0/content/1", json!({"type": "image", "media_index": 0})),
        (Endpoint::Chat, format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{img}"}}}}]}}]}}"#), "/media/0/mime_type", json!("image/png")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}"#.into(), "/media/0/url", json!("https://example.com/cat.png")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"file:///srv/media/cat.png"}}]}]}"#.into(), "/media/0/url", json!("file:///srv/media/cat.png")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"},"uuid":"abc123"}]}]}"#.into(), "/media/0/uuid", json!("abc123")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}"#.into(), "/media/0/param", json!("messages[0].content[0].image_url")),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"h\u00e9 \ud83d\ude00 \"q\""}]}"#.into(), "/messages/0/content/0/text", json!("h\u{e9} \u{1F600} \"q\"")),
        (Endpoint::Completions, r#"{"prompt":"once upon"}"#.into(), "/prompts", json!(["once upon"])),
        (Endpoint::Completions, r#"{"prompt":"once upon"}"#.into(), "/sampling/max_tokens", json!(16)),
        (Endpoint::Completions, r#"{"prompt":["a","b"],"max_tokens":3}"#.into(), "/prompts", json!(["a", "b"])),
        (Endpoint::Completions, r#"{"prompt":[1,2,3]}"#.into(), "/prompts", json!([[1, 2, 3]])),
        (Endpoint::Completions, r#"{"prompt":[[1,2],[3]]}"#.into(), "/prompts", json!([[1, 2], [3]])),
        (Endpoint::Completions, r#"{"prompt":"x","logprobs":2}"#.into(), "/sampling/logprobs", json!(2)),
        (Endpoint::Completions, r#"{"prompt":"x","logprobs":2,"echo":true}"#.into(), "/sampling/prompt_logprobs", json!(2)),
        (Endpoint::Completions, r#"{"prompt":"x","messages":[]}"#.into(), "/unknown_fields", json!(["messages"])),
        (Endpoint::Responses, r#"{"model":"m","input":"tell me"}"#.into(), "/messages", json!([{"role": "user", "content": [{"type": "text", "text": "tell me"}]}])),
        (Endpoint::Responses, r#"{"input":"tell me","instructions":"be brief"}"#.into(), "/messages/0", json!({"role": "system", "content": [{"type": "text", "text": "be brief"}]})),
        (Endpoint::Responses, r#"{"input":"x","max_output_tokens":12}"#.into(), "/sampling/max_tokens", json!(12)),
        // As vLLM: Responses computes logprobs only when `include` asks for them.
        (Endpoint::Responses, r#"{"input":"x","top_logprobs":2}"#.into(), "/sampling/logprobs", json!(null)),
        (Endpoint::Responses, r#"{"input":"x","top_logprobs":2,"include":["message.output_text.logprobs"]}"#.into(), "/sampling/logprobs", json!(2)),
        (Endpoint::Responses, r#"{"input":"x","include":["message.output_text.logprobs"]}"#.into(), "/sampling/logprobs", json!(0)),
        (Endpoint::Responses, format!(r#"{{"input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"see"}},{{"type":"input_image","image_url":"{img}"}}]}}]}}"#), "/media/0/param", json!("input[0].content[1].image_url")),
        (Endpoint::Responses, r#"{"input":[{"role":"assistant","content":[{"type":"output_text","text":"ok"}]},{"role":"user","content":"go"}]}"#.into(), "/messages/1/role", json!("user")),
        (Endpoint::Generate, r#"{"request_id":"r1","token_ids":[1,2,3],"sampling_params":{"max_tokens":4,"temperature":0}}"#.into(), "/sampling/max_tokens", json!(4)),
        (Endpoint::Generate, r#"{"request_id":"r1","token_ids":[1,2,3]}"#.into(), "/request_id", json!("r1")),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"sampling_params":{"extra_args":{"a":1},"bogus":2}}"#.into(), "/unknown_fields", json!(["sampling_params.bogus"])),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"sampling_params":{"extra_args":{"a":1,"b":1}},"vllm_xargs":{"b":2}}"#.into(), "/sampling/extra_args", json!({"a": 1, "b": 2})),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"kv_transfer_params":{"do_remote_prefill":true}}"#.into(), "/sampling/extra_args", json!({"kv_transfer_params": {"do_remote_prefill": true}})),
        (Endpoint::Generate, r#"{"token_ids":[5,9,9,9,6],"features":{"mm_hashes":["ab12"],"mm_placeholders":[{"offset":1,"length":3}],"mm_grid_thw":[[1,2,6]]}}"#.into(), "/features", json!({"mm_hashes": ["ab12"], "mm_placeholders": [{"offset": 1, "length": 3}], "mm_grid_thw": [[1, 2, 6]]})),
        // vLLM's per-modality form comes out flat, in prompt order.
        (Endpoint::Generate, r#"{"token_ids":[5,9,6,9,9],"features":{"mm_hashes":{"image":["cd","ab"]},"mm_placeholders":{"image":[{"offset":3,"length":2},{"offset":1,"length":1}]},"mm_grid_thw":{"image":[[1,2,4],[1,2,2]]},"kwargs_data":{"image":[null,null]},"mm_metadata":null}}"#.into(), "/features", json!({"mm_hashes": ["ab", "cd"], "mm_placeholders": [{"offset": 1, "length": 1}, {"offset": 3, "length": 2}], "mm_grid_thw": [[1, 2, 2], [1, 2, 4]]})),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3]}"#.into(), "/sampling/max_tokens", json!(null)),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"output_mode":"text","return_token_ids":true,"priority":0}"#.into(), "/output_mode", json!("text")),
        (Endpoint::Generate, r#"{"token_ids":[1,2,3],"return_token_ids":"yes"}"#.into(), "/return_token_ids", json!(true)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#.into(), "/continuous_usage_stats", json!(true)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"continuous_usage_stats":true}}"#.into(), "/continuous_usage_stats", json!(false)),
        (Endpoint::Completions, r#"{"prompt":"x","stream_interval":"4"}"#.into(), "/stream_interval", json!(4)),
        (Endpoint::Completions, r#"{"prompt":"x","bad_words":["a b","c","a b"]}"#.into(), "/sampling/bad_words", json!(["a b", "c"])),
        (Endpoint::Generate, r#"{"token_ids":[1],"sampling_params":{"bad_words":["z"]}}"#.into(), "/sampling/bad_words", json!(["z"])),
        (Endpoint::Chat, r#"{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true,"add_generation_prompt":false}"#.into(), "/continue_final_message", json!(true)),
        (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":-1,"truncation_side":"left"}"#.into(), "/truncate_prompt_tokens", json!(-1)),
        (Endpoint::Completions, r#"{"prompt":"x","truncate_prompt_tokens":"5","truncation_side":"right"}"#.into(), "/truncation_side", json!("right")),
    ];
    for (endpoint, body, pointer, expected) in rows {
        let parsed = json(&ok(endpoint, &body));
        let got = parsed
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{body}: no {pointer} in {parsed}"));
        assert_eq!(got, &expected, "{body} at {pointer}");
    }
}

#[test]
fn transfer_params_reach_extra_args_on_every_endpoint() {
    let bodies = [
        (
            Endpoint::Chat,
            r#""messages":[{"role":"user","content":"hi"}]"#,
        ),
        (Endpoint::Completions, r#""prompt":"hi""#),
        (Endpoint::Responses, r#""input":"hi""#),
        (Endpoint::Generate, r#""token_ids":[1]"#),
    ];
    for (endpoint, core) in bodies {
        let body = format!(
            r#"{{{core},"vllm_xargs":{{"x":1,"ec_transfer_params":"stale"}},"kv_transfer_params":{{}},"ec_transfer_params":{{"h":{{"peer_port":5501}}}}}}"#
        );
        let parsed = json(&ok(endpoint, &body));
        assert_eq!(
            parsed["sampling"]["extra_args"],
            json!({"x": 1, "kv_transfer_params": {}, "ec_transfer_params": {"h": {"peer_port": 5501}}}),
            "{endpoint:?}"
        );
        assert_eq!(parsed["kv_transfer_params"], json!({}));
    }
}

#[test]
fn typed_result_matches_json_view() {
    let img = format!("data:image/png;base64,{PNG_B64}");
    let body = format!(
        r#"{{"messages":[{{"role":"system","content":"s"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{img}"}}}},{{"type":"image_url","image_url":{{"url":"{img}"}},"uuid":"My-UUID"}}]}}]}}"#
    );
    let r = ok(Endpoint::Chat, &body);
    let messages = r.messages.as_ref().expect("chat has messages");
    assert_eq!(messages[0].role, Role::System);
    assert_eq!(messages[1].content[1], Part::Image { media_index: 1 });
    assert_eq!(r.media.len(), 2);
    let data = r.media[0].data.as_ref().expect("inline data");
    assert_eq!(&data[1..4], b"PNG");
    assert_eq!(
        r.media[0].mm_hash,
        ec_core::compute_mm_hash(data, "test-model", None)
    );
    let scope = ec_core::KeyScope::new("test-model", None, None);
    assert_eq!(r.media[1].mm_hash, scope.uuid_hash("My-UUID"));
    assert_ne!(r.media[1].mm_hash, "My-UUID");
    let c = ok(Endpoint::Completions, r#"{"prompt":[[7]]}"#);
    assert_eq!(c.prompts, Some(vec![Prompt::Tokens(vec![7])]));
}

#[test]
fn processor_kwargs_and_model_enter_the_hash() {
    let img = format!("data:image/png;base64,{PNG_B64}");
    let body = |kwargs: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{img}"}}}}]}}]{kwargs}}}"#
        )
    };
    let plain = ok(Endpoint::Chat, &body("")).media[0].mm_hash.clone();
    let a = ok(
        Endpoint::Chat,
        &body(r#","mm_processor_kwargs":{"max_pixels":1000,"min_pixels":10}"#),
    );
    let b = ok(
        Endpoint::Chat,
        &body(r#","mm_processor_kwargs":{"min_pixels":10,"max_pixels":1000}"#),
    );
    assert_eq!(
        a.media[0].mm_hash, b.media[0].mm_hash,
        "key order must not matter"
    );
    assert_ne!(a.media[0].mm_hash, plain);
    let other_model = ec_core::parse_request(
        Endpoint::Chat,
        body("").as_bytes(),
        "other",
        &Default::default(),
    )
    .expect("valid");
    assert_ne!(other_model.media[0].mm_hash, plain);
    assert!(ec_core::is_valid_mm_hash(&plain) && plain.len() == 64);
}
