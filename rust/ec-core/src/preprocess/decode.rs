//! Format sniffing, the header-only probe, and decoding to 8-bit RGB as Pillow plus
//! transformers' `convert_rgb` produce it.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder};

use super::jpeg;
use super::{PreprocessError, Result};

/// A decodable format. Names follow Pillow's (`"PNG"`, `"JPEG"`, `"WEBP"`, `"GIF"`, `"BMP"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    Png,
    Jpeg,
    WebP,
    Gif,
    Bmp,
}

impl ImageFormat {
    /// Every decodable format.
    pub const ALL: [ImageFormat; 5] = [Self::Png, Self::Jpeg, Self::WebP, Self::Gif, Self::Bmp];

    /// Pillow's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WEBP",
            Self::Gif => "GIF",
            Self::Bmp => "BMP",
        }
    }

    /// The format with Pillow's name `name` (case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// The format of `data` from its magic bytes.
    pub fn sniff(data: &[u8]) -> Option<Self> {
        if data.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(Self::Png)
        } else if data.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(Self::Jpeg)
        } else if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
            Some(Self::WebP)
        } else if data.starts_with(b"GIF87a") || data.starts_with(b"GIF89a") {
            Some(Self::Gif)
        } else if data.starts_with(b"BM") {
            Some(Self::Bmp)
        } else {
            None
        }
    }
}

/// Formats recognised only to name them in an error.
fn foreign_format(data: &[u8]) -> Option<&'static str> {
    let head = &data[..data.len().min(512)];
    let text = String::from_utf8_lossy(head).to_ascii_lowercase();
    if data.starts_with(b"II*\0") || data.starts_with(b"MM\0*") {
        Some("TIFF")
    } else if data.len() >= 12 && &data[4..8] == b"ftyp" {
        match &data[8..12] {
            b"avif" | b"avis" => Some("AVIF"),
            b"heic" | b"heix" | b"hevc" | b"hevx" | b"mif1" | b"msf1" | b"heim" | b"heis" => {
                Some("HEIC")
            }
            _ => Some("ISO media (MP4/HEIF)"),
        }
    } else if text.contains("<svg")
        || (text.trim_start().starts_with("<?xml") && text.contains("svg"))
    {
        Some("SVG")
    } else if data.starts_with(&[0xFF, 0x0A]) || data.starts_with(b"\0\0\0\x0cJXL ") {
        Some("JPEG XL")
    } else if data.starts_with(b"\0\0\x01\0") {
        Some("ICO")
    } else if data.starts_with(b"%PDF") {
        Some("PDF")
    } else {
        None
    }
}

fn allowed_names(allowed: &[ImageFormat]) -> String {
    allowed
        .iter()
        .map(|f| f.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the header says: the format and the size in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

fn corrupt(e: impl std::fmt::Display) -> PreprocessError {
    let message = e.to_string();
    let lower = message.to_ascii_lowercase();
    if lower.contains("unexpected end") || lower.contains("eof") || lower.contains("truncat") {
        PreprocessError::Truncated
    } else {
        PreprocessError::Corrupt { message }
    }
}

fn image_err(e: image::ImageError) -> PreprocessError {
    match e {
        image::ImageError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            PreprocessError::Truncated
        }
        other => corrupt(other),
    }
}

/// The format and size of `data` from its header; no pixel is decoded and nothing the
/// size of the image is allocated. Only formats in `allowed` are accepted.
pub fn probe(data: &[u8], allowed: &[ImageFormat]) -> Result<ImageInfo> {
    if data.is_empty() {
        return Err(PreprocessError::Empty);
    }
    let format = match ImageFormat::sniff(data) {
        Some(f) if allowed.contains(&f) => f,
        Some(f) => {
            return Err(PreprocessError::UnsupportedFormat {
                format: f.name(),
                allowed: allowed_names(allowed),
            })
        }
        None => {
            return Err(match foreign_format(data) {
                Some(format) => PreprocessError::UnsupportedFormat {
                    format,
                    allowed: allowed_names(allowed),
                },
                None => PreprocessError::UnknownFormat {
                    allowed: allowed_names(allowed),
                },
            })
        }
    };
    let (width, height) = match format {
        ImageFormat::Jpeg => jpeg::dimensions(data)?,
        ImageFormat::Png => decoder_dims(image::codecs::png::PngDecoder::new(Cursor::new(data)))?,
        ImageFormat::Gif => {
            check_gif_blocks(data)?;
            decoder_dims(image::codecs::gif::GifDecoder::new(Cursor::new(data)))?
        }
        ImageFormat::Bmp => decoder_dims(image::codecs::bmp::BmpDecoder::new(Cursor::new(data)))?,
        ImageFormat::WebP => {
            decoder_dims(image::codecs::webp::WebPDecoder::new(Cursor::new(data)))?
        }
    };
    if width == 0 || height == 0 {
        return Err(PreprocessError::ZeroSize { width, height });
    }
    Ok(ImageInfo {
        format,
        width,
        height,
    })
}

/// A GIF's first block after the screen descriptor and global colour table must be an
/// extension (`!`) or an image (`,`), as Pillow requires before it reports a size: a
/// 13-byte header alone is not an image.
fn check_gif_blocks(data: &[u8]) -> Result<()> {
    const SCREEN_END: usize = 13;
    let packed = *data.get(10).ok_or(PreprocessError::Truncated)?;
    let table = if packed & 0x80 != 0 {
        3 << ((packed & 0x07) + 1)
    } else {
        0
    };
    match data.get(SCREEN_END + table) {
        Some(b'!' | b',') => Ok(()),
        Some(_) => Err(PreprocessError::Corrupt {
            message: "no GIF block after the screen descriptor".into(),
        }),
        None => Err(PreprocessError::Truncated),
    }
}

fn decoder_dims<D: ImageDecoder>(decoder: image::ImageResult<D>) -> Result<(u32, u32)> {
    decoder.map(|d| d.dimensions()).map_err(image_err)
}

/// An 8-bit RGB image, rows top to bottom, `3 * width * height` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

/// Decodes `data` (one of `allowed`) to RGB. The size is checked from the header
/// against `max_pixels` before anything is decoded.
pub fn decode_rgb(data: &[u8], allowed: &[ImageFormat], max_pixels: u64) -> Result<RgbImage> {
    let info = probe(data, allowed)?;
    if u64::from(info.width) * u64::from(info.height) > max_pixels {
        return Err(PreprocessError::TooLarge {
            width: info.width,
            height: info.height,
            max_pixels,
        });
    }
    let image = match info.format {
        ImageFormat::Jpeg => return jpeg::decode_rgb(data),
        ImageFormat::Png => from_decoder(image::codecs::png::PngDecoder::new(Cursor::new(data)))?,
        ImageFormat::Gif => from_decoder(image::codecs::gif::GifDecoder::new(Cursor::new(data)))?,
        ImageFormat::Bmp => from_decoder(image::codecs::bmp::BmpDecoder::new(Cursor::new(data)))?,
        ImageFormat::WebP => {
            from_decoder(image::codecs::webp::WebPDecoder::new(Cursor::new(data)))?
        }
    };
    if image.width() != info.width || image.height() != info.height {
        return Err(PreprocessError::Corrupt {
            message: "decoded size differs from the header".into(),
        });
    }
    Ok(to_rgb(image))
}

fn from_decoder<D: ImageDecoder>(decoder: image::ImageResult<D>) -> Result<DynamicImage> {
    DynamicImage::from_decoder(decoder.map_err(image_err)?).map_err(image_err)
}

/// Pillow's `alpha_composite` of one pixel over opaque white (fixed point, 7 extra bits).
#[inline]
pub(crate) fn over_white(value: u8, alpha: u8) -> u8 {
    const PRECISION_BITS: u32 = 7;
    match alpha {
        0 => 255,
        255 => value,
        a => {
            let a = u32::from(a);
            // Background alpha is 255, so the output alpha is 255 * 255.
            let coef1 = a << PRECISION_BITS;
            let coef2 = (255 << PRECISION_BITS) - coef1;
            let tmp = u32::from(value) * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS);
            ((((tmp >> 8) + tmp) >> 8) >> PRECISION_BITS) as u8
        }
    }
}

/// The 8-bit value Pillow keeps of a 16-bit sample: its high byte (rawmodes `;16B`).
#[inline]
fn high_byte(v: u16) -> u8 {
    (v >> 8) as u8
}

/// RGB as transformers' `convert_rgb` makes it from the image Pillow opens: alpha
/// composited over white, grey replicated, 16-bit colour reduced to its high byte,
/// 16-bit grey (Pillow's `I;16`) clipped to 255.
fn to_rgb(image: DynamicImage) -> RgbImage {
    let (width, height) = (image.width(), image.height());
    let n = width as usize * height as usize;
    let mut data = Vec::with_capacity(3 * n);
    match image {
        DynamicImage::ImageRgb8(buf) => return raw_rgb(width, height, buf.into_raw()),
        DynamicImage::ImageLuma8(buf) => {
            for &v in buf.as_raw() {
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA8(buf) => {
            for p in buf.as_raw().chunks_exact(2) {
                let v = over_white(p[0], p[1]);
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageRgba8(buf) => push_rgba(&mut data, buf.as_raw()),
        DynamicImage::ImageLuma16(buf) => {
            for &v in buf.as_raw() {
                let v = v.min(255) as u8;
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA16(buf) => {
            for p in buf.as_raw().chunks_exact(2) {
                let v = over_white(high_byte(p[0]), high_byte(p[1]));
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageRgb16(buf) => data.extend(buf.as_raw().iter().map(|&v| high_byte(v))),
        DynamicImage::ImageRgba16(buf) => {
            let rgba: Vec<u8> = buf.as_raw().iter().map(|&v| high_byte(v)).collect();
            push_rgba(&mut data, &rgba);
        }
        other => return raw_rgb(width, height, other.to_rgb8().into_raw()),
    }
    RgbImage {
        width,
        height,
        data,
    }
}

fn raw_rgb(width: u32, height: u32, data: Vec<u8>) -> RgbImage {
    RgbImage {
        width,
        height,
        data,
    }
}

fn push_rgba(out: &mut Vec<u8>, rgba: &[u8]) {
    for p in rgba.chunks_exact(4) {
        let a = p[3];
        out.extend_from_slice(&[
            over_white(p[0], a),
            over_white(p[1], a),
            over_white(p[2], a),
        ]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_white_matches_pillow_at_the_ends() {
        for v in 0..=255u8 {
            assert_eq!(over_white(v, 255), v);
            assert_eq!(over_white(v, 0), 255);
        }
    }

    #[test]
    fn a_gif_header_alone_is_not_an_image() {
        assert!(probe(b"GIF89a-not-really", &ImageFormat::ALL).is_err());
    }

    #[test]
    fn sniffing_names_foreign_formats() {
        assert_eq!(foreign_format(b"II*\0rest"), Some("TIFF"));
        assert_eq!(foreign_format(b"\0\0\0\x18ftypheic\0\0"), Some("HEIC"));
        assert_eq!(foreign_format(b"<?xml version='1.0'?><svg>"), Some("SVG"));
        assert_eq!(foreign_format(b"hello"), None);
    }
}
