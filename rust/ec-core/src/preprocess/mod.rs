//! Native image preprocessing: bytes -> RGB -> resized -> normalized patches, as
//! transformers' image processors (PIL backend) compute them, without Python.
//!
//! * [`probe`] reads a file's format and size from its header only: a
//!   decompression bomb is refused before a single pixel is allocated, and an
//!   image whose pixels are not needed still gets its grid ([`QwenVlConfig::grid`]).
//! * [`decode_rgb`] decodes PNG, JPEG, WebP, GIF (first frame) and BMP and converts
//!   to 8-bit RGB the way Pillow + transformers' `convert_rgb` do (palette, grey,
//!   16-bit, CMYK, transparency composited over white).
//! * [`resize`] is Pillow's separable convolution resampling (bicubic, bilinear),
//!   fixed-point as Pillow computes it, so resized pixels are bit-identical.
//! * [`QwenVlConfig`] is the Qwen2-VL / Qwen2.5-VL rule (`smart_resize`, rescale,
//!   normalize, patchify into `pixel_values` rows and `image_grid_thw`).
//! * [`ClipConfig`] is the CLIP rule (shortest edge, centre crop, channel-first).

mod clip;
mod decode;
mod jpeg;
mod qwen_vl;
pub mod resize;

pub use clip::{ClipConfig, ClipOutput};
pub use decode::{decode_rgb, probe, ImageFormat, ImageInfo, RgbImage};
pub use qwen_vl::{smart_resize, QwenVlConfig, QwenVlOutput};
pub use resize::Filter;

use thiserror::Error;

/// Why an image cannot be preprocessed. Messages name no image: the caller knows
/// which item of its request failed and says so.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PreprocessError {
    /// No bytes at all.
    #[error("is empty")]
    Empty,
    /// A format this build can recognise but does not decode (SVG, TIFF, HEIC, ...).
    #[error("is a {format} image; supported formats: {allowed}")]
    UnsupportedFormat {
        format: &'static str,
        allowed: String,
    },
    /// Bytes that are no known image format.
    #[error("is not an image in a supported format ({allowed})")]
    UnknownFormat { allowed: String },
    /// A width or height of zero.
    #[error("has a zero width or height ({width}x{height})")]
    ZeroSize { width: u32, height: u32 },
    /// More pixels than the configured limit; found from the header, before decoding.
    #[error("is {width}x{height}, more than {max_pixels} pixels")]
    TooLarge {
        width: u32,
        height: u32,
        max_pixels: u64,
    },
    /// The data ends before the image does.
    #[error("is truncated")]
    Truncated,
    /// A damaged file (bad header, bad compressed data).
    #[error("could not be decoded: {message}")]
    Corrupt { message: String },
    /// The resize rule cannot handle the image (e.g. an aspect ratio over 200).
    #[error("cannot be processed: {message}")]
    Unprocessable { message: String },
    /// A buffer the image needs could not be allocated (the process is out of memory
    /// or under an address-space limit); nothing was aborted.
    #[error("needs {bytes} bytes that could not be allocated")]
    OutOfMemory { bytes: usize },
}

/// `n` default values, or [`PreprocessError::OutOfMemory`] instead of an abort when the
/// allocator refuses (image-sized buffers may be large).
pub(crate) fn alloc<T: Clone + Default>(n: usize) -> Result<Vec<T>> {
    let mut v = reserve(n)?;
    v.resize(n, T::default());
    Ok(v)
}

/// An empty vector with room for `n` values (filled by the caller in order, so no time
/// goes into zeroing it first), or [`PreprocessError::OutOfMemory`].
pub(crate) fn reserve<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| PreprocessError::OutOfMemory {
            bytes: n.saturating_mul(std::mem::size_of::<T>()),
        })?;
    Ok(v)
}

impl PreprocessError {
    /// Short machine-readable reason (the `code` of an OpenAI error body).
    pub fn code(&self) -> &'static str {
        match self {
            Self::TooLarge { .. } => "image_too_large",
            Self::OutOfMemory { .. } => "input_too_large",
            _ => "invalid_image",
        }
    }
}

/// Float32 value of every 8-bit level per channel, as transformers computes it:
/// `float32(v * rescale_factor)` in float64, then `(x - mean) / std` in float32.
pub(crate) fn normalization_lut(rescale: f64, mean: &[f32; 3], std: &[f32; 3]) -> [[f32; 256]; 3] {
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, out) in table.iter_mut().enumerate() {
            let x = (v as f64 * rescale) as f32;
            *out = (x - mean[c]) / std[c];
        }
    }
    lut
}

/// Float32 value of every 8-bit level per channel as transformers' video processors
/// compute it, rescale and normalize fused (`BaseVideoProcessor`): `mean` and `std`
/// divided by `rescale` (`float32 * float32(1 / rescale)`), then `(float32(v) -
/// mean') / std'` in float32.
pub(crate) fn fused_normalization_lut(
    rescale: f64,
    mean: &[f32; 3],
    std: &[f32; 3],
) -> [[f32; 256]; 3] {
    let scale = (1.0 / rescale) as f32;
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        let (m, s) = (mean[c] * scale, std[c] * scale);
        for (v, out) in table.iter_mut().enumerate() {
            *out = (v as f32 - m) / s;
        }
    }
    lut
}

/// `f` over the images of one request, in parallel on rayon's pool (one image runs on
/// the calling thread); results in input order, each image's own error in its slot.
pub(crate) fn each_image<T: Send>(
    images: &[&[u8]],
    f: impl Fn(&[u8]) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    use rayon::prelude::*;
    if images.len() == 1 {
        return vec![f(images[0])];
    }
    images.par_iter().map(|data| f(data)).collect()
}

/// Result of this module.
pub type Result<T> = std::result::Result<T, PreprocessError>;
