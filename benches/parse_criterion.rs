//! Criterion benchmarks of the Rust core: parse + validate + merge (+ decode + hash).
//!
//! Run: `cargo bench -p ec-core --bench parse`. Each case is measured next to a
//! baseline in the same run (`serde_json::from_slice` into a `serde_json::Value`, the
//! floor of merely building a JSON tree), and so is this crate's JSON tree alone
//! (`json_tree_only`); the ratios are printed and written with the medians to
//! `benches/results/criterion_parse.json`.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, Throughput};
use ec_core::{parse_request, Endpoint, Limits};

const SMALL: &[u8] = include_bytes!("fixtures/chat_small.json");
const MULTIMODAL: &[u8] = include_bytes!("fixtures/chat_mm_2_5k.json");

/// A chat request carrying one 1 MiB (decoded) inline image of incompressible bytes.
fn image_request() -> (Vec<u8>, String) {
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let raw: Vec<u8> = (0..1 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        })
        .collect();
    let url = format!(
        "data:image/png;base64,{}",
        base64_simd::STANDARD.encode_to_string(&raw)
    );
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}],"max_tokens":16}}"#
    );
    (body.into_bytes(), url)
}

fn criterion_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/criterion")
}

fn results_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/results/criterion_parse.json")
}

/// (group, ours, baseline, what)
const CASES: &[(&str, &str, &str, &str)] = &[
    (
        "small_text",
        "ec_core",
        "serde_json_value",
        "139 B chat request",
    ),
    (
        "small_text",
        "json_tree_only",
        "serde_json_value",
        "  its JSON tree alone",
    ),
    (
        "multimodal_2_5k",
        "ec_core",
        "serde_json_value",
        "2.5 KB multimodal chat, xargs + kv/ec params",
    ),
    (
        "multimodal_2_5k",
        "json_tree_only",
        "serde_json_value",
        "  its JSON tree alone",
    ),
    (
        "image_1mb",
        "ec_core",
        "serde_json_value",
        "chat with a 1 MiB image (parse+decode+hash)",
    ),
    (
        "image_1mb",
        "json_tree_only",
        "serde_json_value",
        "  its JSON tree alone",
    ),
    (
        "media_1mb",
        "decode_and_hash",
        "decode_only",
        "1 MiB data URL: decode + blake3 vs decode",
    ),
];

fn benches(c: &mut Criterion) {
    let limits = Limits::default();
    let (image_body, image_url) = image_request();
    let bodies: [(&str, &[u8]); 3] = [
        ("small_text", SMALL),
        ("multimodal_2_5k", MULTIMODAL),
        ("image_1mb", &image_body),
    ];
    for (group_name, body) in bodies {
        parse_request(Endpoint::Chat, body, "m", &limits).expect("fixture parses");
        let mut group = c.benchmark_group(group_name);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function("ec_core", |b| {
            b.iter(|| parse_request(Endpoint::Chat, black_box(body), "m", &limits))
        });
        group.bench_function("json_tree_only", |b| {
            b.iter(|| ec_core::parse_body(black_box(body), &limits))
        });
        group.bench_function("serde_json_value", |b| {
            b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(body)))
        });
        group.finish();
    }
    let mut group = c.benchmark_group("media_1mb");
    group.throughput(Throughput::Bytes(1 << 20));
    group.bench_function("decode_and_hash", |b| {
        b.iter(|| {
            let d = ec_core::decode_data_url(black_box(&image_url)).expect("valid");
            ec_core::compute_mm_hash(&d.data, "m", None)
        })
    });
    group.bench_function("decode_only", |b| {
        b.iter(|| ec_core::decode_data_url(black_box(&image_url)).expect("valid"))
    });
    group.finish();
}

fn median_ns(dir: &Path, group: &str, function: &str) -> Option<f64> {
    let path = dir.join(group).join(function).join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn report(dir: &Path) {
    let mut rows = Vec::new();
    println!(
        "\n{:<18} {:>14} {:>14} {:>8}  case",
        "group", "ours", "baseline", "ratio"
    );
    for (group, ours, baseline, what) in CASES {
        let (Some(a), Some(b)) = (median_ns(dir, group, ours), median_ns(dir, group, baseline))
        else {
            continue;
        };
        println!(
            "{group:<18} {:>11.2} us {:>11.2} us {:>7.2}x  {what}",
            a / 1e3,
            b / 1e3,
            a / b
        );
        rows.push(serde_json::json!({
            "group": group, "what": what,
            "ours": ours, "ours_median_ns": a,
            "baseline": baseline, "baseline_median_ns": b,
            "ratio_ours_over_baseline": a / b,
        }));
    }
    if rows.is_empty() {
        return;
    }
    let out = serde_json::json!({
        "command": "cargo bench -p ec-core --bench parse",
        "rows": rows,
    });
    let path = results_path();
    let written = std::fs::write(
        &path,
        serde_json::to_string_pretty(&out).unwrap_or_default(),
    );
    match written {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => eprintln!("could not write {}: {e}", path.display()),
    }
}

fn main() {
    let dir = criterion_dir();
    let mut c = Criterion::default()
        .output_directory(&dir)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(40)
        .configure_from_args();
    benches(&mut c);
    c.final_summary();
    report(&dir);
}
