//! `decode_data_url`: any text either decodes to a non-empty payload that re-encodes to
//! the same bytes, within the size bound the parser's limit checks rely on, or is
//! rejected as a bad data URL or bad base64.

#![no_main]

use ec_core::media::{decode_data_url, decoded_len_bound, split_data_url};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Ok(url) = std::str::from_utf8(input) else {
        return;
    };
    match decode_data_url(url) {
        Ok(decoded) => {
            assert!(!decoded.data.is_empty());
            assert_eq!(decoded.mime_type, decoded.mime_type.to_ascii_lowercase());
            let (mime, payload) = split_data_url(url).expect("decoded, so it splits");
            assert_eq!(mime.to_ascii_lowercase(), decoded.mime_type);
            assert!(decoded_len_bound(payload) >= decoded.data.len());
            let again = format!(
                "data:{};base64,{}",
                decoded.mime_type,
                base64_simd::STANDARD.encode_to_string(&decoded.data)
            );
            assert_eq!(decode_data_url(&again).as_ref(), Ok(&decoded));
        }
        Err(e) => assert!(
            matches!(e.code(), "invalid_data_url" | "invalid_base64"),
            "{e:?}"
        ),
    }
});
