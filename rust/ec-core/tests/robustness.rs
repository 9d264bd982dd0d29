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
