//! Structured outputs and tools: accepted shapes normalize into `structured`, bad ones
//! are refused naming their path; chat messages carry tool calls and tool results.

mod common;

use common::{json, ok, parse};
use ec_core::Endpoint;
use serde_json::json;

fn chat(extra: &str) -> String {
    format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],{extra}}}"#)
}

fn responses(extra: &str) -> String {
    format!(r#"{{"input":"hi",{extra}}}"#)
}

const TOOL: &str = r#"{"type":"function","function":{"name":"get_weather","description":"d","parameters":{"type":"object"}}}"#;

#[test]
fn accepted_shapes_normalize() {
    let tools = format!(r#""tools":[{TOOL}]"#);
    #[rustfmt::skip]
    let rows: Vec<(Endpoint, String, &str, serde_json::Value)> = vec![
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_object"}"#), "/structured/constraint", json!({"kind": "json_object", "spec": null, "param": "response_format"})),
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"},"strict":true}}"#), "/structured/constraint", json!({"kind": "json", "spec": {"type": "object"}, "param": "response_format.json_schema.schema"})),
        (Endpoint::Completions, r#"{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#.into(), "/structured/constraint/kind", json!("json_object")),
        (Endpoint::Chat, chat(r#""structured_outputs":{"regex":"[a-z]+","disable_fallback":true}"#), "/structured/constraint", json!({"kind": "regex", "spec": "[a-z]+", "param": "structured_outputs.regex"})),
        (Endpoint::Completions, r#"{"prompt":"x","structured_outputs":{"choice":["a","b"]}}"#.into(), "/structured/constraint/spec", json!(["a", "b"])),
        (Endpoint::Chat, chat(r#""structured_outputs":{"json":"{\"type\":\"string\"}"}"#), "/structured/constraint/spec", json!("{\"type\":\"string\"}")),
        (Endpoint::Chat, chat(r#""structured_outputs":{"grammar":"start: \"a\""}"#), "/structured/constraint/kind", json!("grammar")),
        (Endpoint::Responses, responses(r#""text":{"format":{"type":"json_schema","name":"x","schema":{"type":"array"}}}"#), "/structured/constraint/param", json!("text.format.schema")),
        (Endpoint::Chat, chat(&tools), "/structured/tool_choice", json!("auto")),
        (Endpoint::Chat, chat(&tools), "/structured/tools", json!([{"name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": false}])),
        (Endpoint::Chat, chat(&format!(r#"{tools},"tool_choice":{{"type":"function","function":{{"name":"get_weather"}}}},"parallel_tool_calls":false"#)), "/structured", json!({"constraint": null, "tools": [{"name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": false}], "tool_choice": "function", "tool_name": "get_weather", "parallel_tool_calls": false})),
        (Endpoint::Responses, responses(r#""tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"tool_choice":{"type":"function","name":"f"}"#), "/structured/tool_name", json!("f")),
        (Endpoint::Chat, chat(r#""response_format":{"type":"text"},"tool_choice":"none""#), "/structured", json!(null)),
        (Endpoint::Chat, chat(r#""response_format":{"type":"structural_tag","structures":[{"begin":"<f=a>","schema":{"type":"object"},"end":"</f>"}],"triggers":["<f="]}"#), "/structured/constraint", json!({"kind": "structural_tag", "spec": {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]}, "param": "response_format"})),
        (Endpoint::Completions, r#"{"prompt":"x","structured_outputs":{"structural_tag":"{\"structures\":[{\"begin\":\"<f>\",\"schema\":true,\"end\":\"\"}],\"triggers\":[\"<f\"]}"}}"#.into(), "/structured/constraint", json!({"kind": "structural_tag", "spec": {"structures": [{"begin": "<f>", "schema": true, "end": ""}], "triggers": ["<f"]}, "param": "structured_outputs.structural_tag"})),
        (Endpoint::Responses, responses(r#""tool_choice":"auto""#), "/structured", json!(null)),
    ];
    for (endpoint, body, pointer, want) in rows {
        let got = json(&ok(endpoint, &body));
        assert_eq!(got.pointer(pointer), Some(&want), "{body}");
    }
}

#[test]
fn bad_shapes_name_their_path() {
    let tools = format!(r#""tools":[{TOOL}]"#);
    #[rustfmt::skip]
    let rows: Vec<(Endpoint, String, &str)> = vec![
        (Endpoint::Chat, chat(r#""response_format":{"type":"yaml"}"#), "response_format.type"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_schema"}"#), "response_format.json_schema"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_schema","json_schema":{"schema":{}}}"#), "response_format.json_schema.name"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_schema","json_schema":{"name":"x","schema":[1]}}"#), "response_format.json_schema.schema"),
        (Endpoint::Chat, chat(r#""response_format":"json""#), "response_format"),
        (Endpoint::Chat, chat(r#""structured_outputs":{}"#), "structured_outputs"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"regex":"a","choice":["a"]}"#), "structured_outputs"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"choice":[]}"#), "structured_outputs.choice"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"choice":["a",1]}"#), "structured_outputs.choice[1]"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"regex":5}"#), "structured_outputs.regex"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"structural_tag":"x"}"#), "structured_outputs.structural_tag"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"structural_tag":{"structures":[],"triggers":["<f"]}}"#), "structured_outputs.structural_tag.structures"),
        (Endpoint::Chat, chat(r#""structured_outputs":{"structural_tag":"{\"structures\":[{\"begin\":\"<g>\",\"schema\":{},\"end\":\"</g>\"}],\"triggers\":[\"<f\"]}"}"#), "structured_outputs.structural_tag.structures[0].begin"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"structural_tag","structures":[{"begin":"<f>","end":"</f>"}],"triggers":["<f"]}"#), "response_format.structures[0].schema"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"structural_tag","structures":[{"begin":"<f>","schema":{},"end":"</f>"}],"triggers":[]}"#), "response_format.triggers"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"structural_tag","format":{"type":"triggered_tags"}}"#), "response_format.format"),
        (Endpoint::Responses, responses(r#""text":{"format":{"type":"structural_tag","structures":[],"triggers":[]}}"#), "text.format.type"),
        (Endpoint::Chat, chat(r#""response_format":{"type":"json_object"},"structured_outputs":{"regex":"a"}"#), "structured_outputs"),
        (Endpoint::Responses, responses(r#""text":{"format":{"type":"json_schema","name":"x"}}"#), "text.format.schema"),
        (Endpoint::Chat, chat(r#""tools":[]"#), "tools"),
        (Endpoint::Chat, chat(r#""tools":{}"#), "tools"),
        (Endpoint::Chat, chat(r#""tools":[{"type":"retrieval"}]"#), "tools[0].type"),
        (Endpoint::Chat, chat(r#""tools":[{"type":"function"}]"#), "tools[0].function"),
        (Endpoint::Chat, chat(r#""tools":[{"type":"function","function":{"name":"bad name"}}]"#), "tools[0].function.name"),
        (Endpoint::Chat, chat(r#""tools":[{"type":"function","function":{"name":"f","parameters":"x"}}]"#), "tools[0].function.parameters"),
        (Endpoint::Chat, chat(&format!(r#""tools":[{TOOL},{TOOL}]"#)), "tools[1]"),
        (Endpoint::Responses, responses(r#""tools":[{"type":"function"}]"#), "tools[0].name"),
        (Endpoint::Chat, chat(&format!(r#"{tools},"tool_choice":{{"type":"function","function":{{"name":"nope"}}}}"#)), "tool_choice.function.name"),
        (Endpoint::Chat, chat(&format!(r#"{tools},"tool_choice":"sometimes""#)), "tool_choice"),
        (Endpoint::Chat, chat(r#""tool_choice":"required""#), "tool_choice"),
        (Endpoint::Chat, chat(r#""tool_choice":"auto""#), "tool_choice"),
        (Endpoint::Chat, chat(&format!(r#"{tools},"tool_choice":"required","response_format":{{"type":"json_object"}}"#)), "tool_choice"),
        (Endpoint::Chat, chat(&format!(r#"{tools},"parallel_tool_calls":"maybe""#)), "parallel_tool_calls"),
        (Endpoint::Chat, r#"{"messages":[{"role":"assistant","tool_calls":[{"type":"function","function":{"name":"f"}}]}]}"#.into(), "messages[0].tool_calls[0].function.arguments"),
        (Endpoint::Chat, r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{}}}]}]}"#.into(), "messages[0].tool_calls[0].function.arguments"),
        (Endpoint::Chat, r#"{"messages":[{"role":"tool","tool_call_id":"c1"}]}"#.into(), "messages[0].content"),
        (Endpoint::Chat, r#"{"messages":[{"role":"tool","content":"x","tool_call_id":5}]}"#.into(), "messages[0].tool_call_id"),
    ];
    for (endpoint, body, param) in rows {
        let err = parse(endpoint, &body).expect_err(&body);
        assert_eq!(err.param(), Some(param), "{body}: {err:?}");
    }
}

#[test]
fn tool_messages_reach_the_parsed_request() {
    let body = r#"{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}]}"#;
    let p = json(&ok(Endpoint::Chat, body));
    assert_eq!(p.pointer("/messages/1/role"), Some(&json!("assistant")));
    assert_eq!(
        p.pointer("/messages/1/tool_calls/0/function/arguments"),
        Some(&json!("{\"city\":\"Oslo\"}"))
    );
    assert_eq!(p.pointer("/messages/2/role"), Some(&json!("tool")));
    assert_eq!(p.pointer("/messages/2/tool_call_id"), Some(&json!("c1")));
    assert_eq!(
        p.pointer("/messages/2/content"),
        Some(&json!([{"type": "text", "text": "sunny"}]))
    );
}
