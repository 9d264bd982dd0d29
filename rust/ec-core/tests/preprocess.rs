//! The native image path without Python: `smart_resize` against transformers' values,
//! header probing, RGB conversion, the patch layout and typed errors.

use std::io::Cursor;

use ec_core::preprocess::{
    decode_rgb, probe, smart_resize, ImageFormat, PreprocessError, QwenVlConfig,
};
use image::{ImageEncoder, ImageFormat as Fmt, RgbImage, RgbaImage};

fn png_rgb(w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
    let img = RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y)));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, Fmt::Png).unwrap();
    out.into_inner()
}

fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&[0, 0, 0], 1, 1, image::ExtendedColorType::Rgb8)
        .unwrap();
    // Rewrite IHDR's size (bytes 16..24) and its CRC (bytes 29..33).
    png[16..20].copy_from_slice(&w.to_be_bytes());
    png[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    png
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn smart_resize_matches_transformers() {
    // (h, w, min_pixels, max_pixels) -> transformers' smart_resize(h, w, 28, ...).
    let cases = [
        ((720, 1280, 3136, 12_845_056), (728, 1288)),
        ((1, 1, 3136, 1_003_520), (56, 56)),
        ((4000, 3000, 3136, 1_003_520), (1148, 840)),
        ((2, 400, 3136, 1_003_520), (28, 812)),
        ((97, 131, 3136, 50_176), (84, 140)),
        ((42, 42, 3136, 1_003_520), (56, 56)), // 1.5 rounds to 2 (half to even)
        ((70, 70, 3136, 1_003_520), (56, 56)), // 2.5 rounds to 2 (half to even)
    ];
    for ((h, w, lo, hi), want) in cases {
        assert_eq!(smart_resize(h, w, 28, lo, hi), Ok(want), "{h}x{w}");
    }
    assert!(matches!(
        smart_resize(1, 201, 28, 3136, 1_003_520),
        Err(PreprocessError::Unprocessable { .. })
    ));
}

#[test]
fn probe_reads_the_header_and_refuses_bombs_before_decoding() {
    let bomb = png_header(30_000, 30_000);
    let info = probe(&bomb, &ImageFormat::ALL).unwrap();
    assert_eq!(
        (info.format, info.width, info.height),
        (ImageFormat::Png, 30_000, 30_000)
    );
    assert_eq!(
        decode_rgb(&bomb, &ImageFormat::ALL, 64_000_000),
        Err(PreprocessError::TooLarge {
            width: 30_000,
            height: 30_000,
            max_pixels: 64_000_000
        })
    );
    // The PNG decoder itself refuses a zero width in IHDR.
    let zero = probe(&png_header(0, 7), &ImageFormat::ALL).unwrap_err();
    assert_eq!(zero.code(), "invalid_image");
    assert!(matches!(
        probe(&bomb, &[ImageFormat::Jpeg]),
        Err(PreprocessError::UnsupportedFormat { format: "PNG", .. })
    ));
    assert_eq!(probe(b"", &ImageFormat::ALL), Err(PreprocessError::Empty));
}

#[test]
fn transparency_is_composited_over_white() {
    let img = RgbaImage::from_fn(3, 1, |x, _| {
        image::Rgba([10, 20, 30, [0, 255, 128][x as usize]])
    });
    let mut png = Cursor::new(Vec::new());
    img.write_to(&mut png, Fmt::Png).unwrap();
    let rgb = decode_rgb(png.get_ref(), &ImageFormat::ALL, 1 << 20).unwrap();
    assert_eq!(&rgb.data[..3], &[255, 255, 255]);
    assert_eq!(&rgb.data[3..6], &[10, 20, 30]);
    // Pillow: (v * a + 255 * (255 - a)) / 255, rounded in its fixed point.
    assert_eq!(&rgb.data[6..9], &[132, 137, 142]);
}

#[test]
fn patches_follow_the_merge_window_layout() {
    // 56x56 needs no resize: the grid is 4x4 patches of 14, merge 2, temporal 2.
    let data = png_rgb(56, 56, |x, y| [(x * 4) as u8, (y * 4) as u8, 7]);
    let config = QwenVlConfig {
        image_mean: [0.0; 3],
        image_std: [1.0; 3],
        rescale_factor: 1.0,
        ..QwenVlConfig::default()
    };
    let out = config
        .preprocess(&data, &ImageFormat::ALL, 1 << 20)
        .unwrap();
    assert_eq!(out.grid_thw, (1, 4, 4));
    assert_eq!(out.patch_dim, 3 * 2 * 14 * 14);
    assert_eq!(out.pixel_values.len(), 16 * out.patch_dim);
    let value = |row: usize, c: usize, t: usize, ph: usize, pw: usize| {
        out.pixel_values[row * out.patch_dim + ((c * 2 + t) * 14 + ph) * 14 + pw]
    };
    // Row 3 is merge window (0, 0), patch (mh 1, mw 1): pixels y 14.., x 14...
    assert_eq!(value(3, 0, 0, 0, 0), (14 * 4) as f32);
    assert_eq!(value(3, 1, 0, 0, 0), (14 * 4) as f32);
    // Row 4 is merge window (0, 1), patch (0, 0): x from 28.
    assert_eq!(value(4, 0, 0, 0, 5), ((28 + 5) * 4) as f32);
    assert_eq!(value(4, 1, 1, 2, 0), (2 * 4) as f32);
    assert_eq!(value(4, 2, 1, 13, 13), 7.0);
    // The frame is repeated for the temporal patch.
    for row in 0..16 {
        for c in 0..3 {
            assert_eq!(value(row, c, 0, 6, 9), value(row, c, 1, 6, 9));
        }
    }
    assert_eq!(config.num_tokens(56, 56), Ok(4));
}

#[test]
fn damaged_files_are_typed_errors() {
    let png = png_rgb(40, 30, |x, y| [x as u8, y as u8, 0]);
    for cut in [png.len() / 2, 60, 34] {
        let err = decode_rgb(&png[..cut], &ImageFormat::ALL, 1 << 20).unwrap_err();
        assert!(
            matches!(
                err,
                PreprocessError::Truncated | PreprocessError::Corrupt { .. }
            ),
            "{cut}: {err:?}"
        );
        assert_eq!(err.code(), "invalid_image");
    }
    let not_jpeg = [0xFF, 0xD8, 0xFF, 0xE0, 0, 4, 1, 2, 3, 4, 5];
    assert!(decode_rgb(&not_jpeg, &ImageFormat::ALL, 1 << 20).is_err());
    assert!(matches!(
        probe(b"II*\0\x08\0\0\0", &ImageFormat::ALL),
        Err(PreprocessError::UnsupportedFormat { format: "TIFF", .. })
    ));
}
