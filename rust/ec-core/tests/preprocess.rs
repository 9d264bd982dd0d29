//! The native image path without Python: `smart_resize` against transformers' values,
//! header probing, RGB conversion, the patch layout and typed errors.

use std::io::Cursor;

use ec_core::preprocess::{
    decode_rgb, probe, smart_resize, ImageFormat, PreprocessError, QwenVlConfig, RgbImage as Rgb,
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

/// A `w` x `h` RGB frame whose values depend on `seed` and the position.
fn frame(w: u32, h: u32, seed: u32) -> Rgb {
    let data = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) as u8)
        .collect();
    Rgb {
        width: w,
        height: h,
        data,
    }
}

#[test]
fn video_frames_are_image_rows_in_temporal_slots() {
    // 84x56 needs no resize; 100x70 is resized. Identity normalization: the image
    // rule's two steps and the video rule's fused one agree on it.
    for (w, h) in [(84u32, 56u32), (100, 70)] {
        let config = QwenVlConfig {
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            rescale_factor: 1.0,
            ..QwenVlConfig::default()
        };
        let frames: Vec<Rgb> = (0..3).map(|i| frame(w, h, i)).collect();
        let images: Vec<_> = frames
            .iter()
            .map(|f| config.preprocess_rgb(f).unwrap())
            .collect();
        let joined: Vec<u8> = frames.iter().flat_map(|f| f.data.clone()).collect();
        let video = config.preprocess_video(&joined, 3, w, h).unwrap();
        let (_, gh, gw) = images[0].grid_thw;
        // Three frames are padded to four: two temporal patches, the last frame twice.
        assert_eq!(video.grid_thw, (2, gh, gw));
        let dim = video.patch_dim;
        let rows = (gh * gw) as usize;
        assert_eq!(video.pixel_values.len(), 2 * rows * dim);
        let plane = 14 * 14;
        for g in 0..2 {
            for row in 0..rows {
                for c in 0..3 {
                    for k in 0..2 {
                        let source = (g * 2 + k).min(2);
                        let at = ((g * rows + row) * dim) + (c * 2 + k) * plane;
                        let want = row * dim + (c * 2) * plane;
                        assert_eq!(
                            video.pixel_values[at..at + plane],
                            images[source].pixel_values[want..want + plane],
                            "{w}x{h}: temporal patch {g}, row {row}, channel {c}, slot {k}"
                        );
                    }
                }
            }
        }
        // One frame is the image: its temporal patch repeats it.
        let one = config.preprocess_video(&frames[1].data, 1, w, h).unwrap();
        assert_eq!(one, images[1]);
    }
}

#[test]
fn video_sizes_are_checked() {
    let config = QwenVlConfig::default();
    assert!(matches!(
        config.preprocess_video(&[], 0, 56, 56),
        Err(PreprocessError::ZeroSize { .. })
    ));
    assert!(matches!(
        config.preprocess_video(&[0; 56 * 56 * 3], 2, 56, 56),
        Err(PreprocessError::Corrupt { .. })
    ));
    assert!(matches!(
        config.preprocess_video(&[0; 300 * 3], 1, 300, 1),
        Err(PreprocessError::Unprocessable { .. })
    ));
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
