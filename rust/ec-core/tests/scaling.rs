//! Parsing is linear in the body: doubling one list or map field of a request at most
//! about doubles the time of `parse_request` (the Python suite's
//! `tests/core/test_parse_scaling.py` checks every field through the bindings).
//!
//! One test runs the cases one after the other (the harness runs tests on parallel
//! threads, which would time each other). Each case times N, 2N and 4N entries (the
//! thread's CPU time, each sample repeated to last about `SAMPLE`, the best of a few
//! interleaved rounds) next to a reference, serde_json's tree of the same bodies: as
//! the data outgrows the caches everything costs more per entry, so each doubling's
//! ratio is scaled by the reference's (`ratio * 2 / reference ratio`) and must stay
//! under `MAX_RATIO`. A quadratic spot costs about 4x per doubling.

use std::hint::black_box;
use std::time::{Duration, Instant};

use ec_core::{parse_request, Endpoint, Limits};
use serde_json::{json, Value};

const MAX_RATIO: f64 = 2.5;
const ROUNDS: usize = 5;
/// Measurements of a case before it fails.
const ATTEMPTS: usize = 3;
/// Each sample repeats the parse to last about this long.
const SAMPLE: Duration = Duration::from_millis(10);
/// No round starts past this (a quadratic parser takes seconds per run).
const BUDGET: Duration = Duration::from_secs(10);

struct Case {
    name: &'static str,
    endpoint: Endpoint,
    body: fn(usize) -> Value,
    base: usize,
    /// The `param` of the expected error, for a body refused after the whole field
    /// was read; `None`: the body parses.
    error_param: Option<&'static str>,
    limits: Limits,
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

fn tool(i: usize) -> Value {
    json!({"type": "function", "function": {"name": format!("tool_{i}"), "parameters": {"type": "object"}}})
}

fn structural_tag(n: usize) -> Value {
    // Every begin starts with the last trigger.
    let triggers: Vec<String> = (0..n).map(|i| format!("<t{i}>")).collect();
    let structures: Vec<Value> = (0..n)
        .map(|i| json!({"begin": format!("<t{}>{i}", n - 1), "schema": {"type": "object"}, "end": "</t>"}))
        .collect();
    json!({"type": "structural_tag", "triggers": triggers, "structures": structures})
}

fn keys(prefix: &str, n: usize) -> Value {
    Value::Object((0..n).map(|i| (format!("{prefix}{i}"), json!(i))).collect())
}

fn many_messages() -> Limits {
    Limits {
        max_messages: usize::MAX,
        ..Limits::default()
    }
}

fn cases() -> Vec<Case> {
    let case = |name, endpoint, body: fn(usize) -> Value, base| Case {
        name,
        endpoint,
        body,
        base,
        error_param: None,
        limits: Limits::default(),
    };
    vec![
        case(
            "bad_words",
            Endpoint::Chat,
            |n| chat(json!({"bad_words": (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>()})),
            20_000,
        ),
        case(
            "tools",
            Endpoint::Chat,
            |n| chat(json!({"tools": (0..n).map(tool).collect::<Vec<_>>()})),
            4_000,
        ),
        Case {
            limits: many_messages(),
            ..case(
                "messages",
                Endpoint::Chat,
                |n| json!({"messages": (0..n).map(|i| json!({"role": "user", "content": format!("m{i}")})).collect::<Vec<_>>()}),
                5_000,
            )
        },
        case(
            "content_parts",
            Endpoint::Chat,
            |n| {
                let parts: Vec<Value> = (0..n)
                    .map(|i| json!({"type": "text", "text": format!("p{i}")}))
                    .collect();
                json!({"messages": [{"role": "user", "content": parts}]})
            },
            10_000,
        ),
        Case {
            error_param: Some("stop"),
            ..case(
                "stop",
                Endpoint::Chat,
                |n| chat(json!({"stop": (0..n).map(|i| format!("s{i}")).collect::<Vec<_>>()})),
                50_000,
            )
        },
        case(
            "stop_token_ids",
            Endpoint::Chat,
            |n| chat(json!({"stop_token_ids": (0..n).collect::<Vec<_>>()})),
            50_000,
        ),
        case(
            "allowed_token_ids",
            Endpoint::Chat,
            |n| chat(json!({"allowed_token_ids": (0..n).collect::<Vec<_>>()})),
            50_000,
        ),
        case(
            "logit_bias",
            Endpoint::Chat,
            |n| chat(json!({"logit_bias": keys("", n)})),
            20_000,
        ),
        case(
            "choice",
            Endpoint::Chat,
            |n| {
                chat(
                    json!({"structured_outputs": {"choice": (0..n).map(|i| format!("c{i}")).collect::<Vec<_>>()}}),
                )
            },
            20_000,
        ),
        case(
            "structural_tag",
            Endpoint::Chat,
            |n| chat(json!({"response_format": structural_tag(n)})),
            3_000,
        ),
        case(
            "vllm_xargs",
            Endpoint::Chat,
            |n| {
                chat(
                    json!({"vllm_xargs": keys("k", n), "kv_transfer_params": {"do_remote_decode": true}}),
                )
            },
            20_000,
        ),
        case(
            "generate_extra_args_and_xargs",
            Endpoint::Generate,
            |n| json!({"token_ids": [1, 2], "sampling_params": {"extra_args": keys("e", n)}, "vllm_xargs": keys("x", n)}),
            10_000,
        ),
        Case {
            error_param: Some("features.mm_hashes.m0"),
            ..case(
                "features_modalities",
                Endpoint::Generate,
                |n| {
                    let reversed = |v: Value| {
                        Value::Object((0..n).rev().map(|i| (format!("m{i}"), v.clone())).collect())
                    };
                    json!({"token_ids": [1, 2], "features": {
                        "mm_hashes": Value::Object((0..n).map(|i| (format!("m{i}"), json!([]))).collect()),
                        "mm_placeholders": reversed(json!([])),
                        "mm_metadata": reversed(json!([])),
                    }})
                },
                5_000,
            )
        },
    ]
}

/// Parses `body` and checks the outcome against the case's.
fn run(case: &Case, body: &[u8]) {
    match (
        parse_request(case.endpoint, body, "m", &case.limits),
        case.error_param,
    ) {
        (Ok(parsed), None) => {
            black_box(parsed);
        }
        (Err(e), Some(param)) => assert_eq!(e.param(), Some(param), "{}", case.name),
        (got, _) => panic!("{}: unexpected outcome {got:?}", case.name),
    }
}

/// This thread's CPU time (waiting for a core on a shared machine does not count).
fn cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The reference: serde_json's tree of the same body (a linear parser whose
/// allocations meet the same caches).
fn reference(body: &[u8]) {
    black_box(serde_json::from_slice::<Value>(body).expect("a JSON body"));
}

/// Best CPU time per size over interleaved rounds, per parse, for the parser and the
/// reference; once two sizes have a time, no run starts past the wall-time budget and
/// the sizes left stay at `f64::INFINITY`.
fn timings(case: &Case, bodies: &[Vec<u8>]) -> (Vec<f64>, Vec<f64>) {
    let mut ours = vec![f64::INFINITY; bodies.len()];
    let mut refs = vec![f64::INFINITY; bodies.len()];
    let sample = |f: &dyn Fn(), times: u32| {
        let start = cpu_time();
        for _ in 0..times {
            f();
        }
        (cpu_time() - start).as_secs_f64() / f64::from(times)
    };
    let began = Instant::now();
    let first = sample(&|| run(case, &bodies[0]), 1);
    let times = (SAMPLE.as_secs_f64() / first.max(1e-6))
        .ceil()
        .clamp(1.0, 1e4) as u32;
    'rounds: for _ in 0..ROUNDS {
        for (i, body) in bodies.iter().enumerate() {
            if i >= 2 && began.elapsed() > BUDGET {
                break 'rounds;
            }
            ours[i] = ours[i].min(sample(&|| run(case, body), times));
            refs[i] = refs[i].min(sample(&|| reference(body), times));
        }
        if began.elapsed() > BUDGET {
            break;
        }
    }
    (ours, refs)
}

#[test]
fn doubling_a_field_at_most_doubles_the_parse_time() {
    let mut failures = Vec::new();
    for case in cases() {
        let sizes = [case.base, 2 * case.base, 4 * case.base];
        let bodies: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| serde_json::to_vec(&(case.body)(n)).expect("a JSON body"))
            .collect();
        // A case that fails is measured again (noise rarely repeats; a square does).
        for attempt in 1..=ATTEMPTS {
            let (ours, refs) = timings(&case, &bodies);
            let ratio = |t: &[f64]| -> Vec<f64> { t.windows(2).map(|w| w[1] / w[0]).collect() };
            let (ratios, ref_ratios) = (ratio(&ours), ratio(&refs));
            let scaled: Vec<f64> = ratios
                .iter()
                .zip(&ref_ratios)
                .map(|(r, rr)| r * 2.0 / rr)
                .collect();
            let ms: Vec<f64> = ours.iter().map(|t| t * 1e3).collect();
            let line = format!(
                "{} (attempt {attempt}): {ms:.2?} ms at {sizes:?}, ratios {ratios:.2?}, \
                 serde_json {ref_ratios:.2?}, scaled {scaled:.2?}",
                case.name
            );
            println!("{line}");
            if scaled.iter().all(|r| *r <= MAX_RATIO) {
                break;
            }
            if attempt == ATTEMPTS || ours.contains(&f64::INFINITY) {
                failures.push(line);
                break;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "grows faster than linearly: {failures:#?}"
    );
}
