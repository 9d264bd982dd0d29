//! The CLIP image rule (LLaVA-1.5 and other CLIP-tower families), as transformers'
//! `CLIPImageProcessor` (PIL backend) computes it: the shortest edge resized to
//! `shortest_edge` (the other edge `int(shortest_edge * long / short)`), Pillow
//! resampling, a centre crop of `crop_height` x `crop_width`, then the same rescale and
//! normalization as the Qwen-VL rule, written channel-first (`[3, crop_height,
//! crop_width]`).

use super::resize::{resize, Filter};
use super::RgbImage;
use super::{
    decode_rgb, each_image, normalization_lut, reserve, ImageFormat, PreprocessError, Result,
};

/// The checkpoint's `preprocessor_config.json` values the rule reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipConfig {
    pub shortest_edge: u32,
    pub crop_height: u32,
    pub crop_width: u32,
    pub rescale_factor: f64,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub filter: Filter,
}

/// One preprocessed image: `[3, height, width]` float32, channel-first.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipOutput {
    pub pixel_values: Vec<f32>,
    pub height: u32,
    pub width: u32,
}

impl ClipConfig {
    /// Checks the values a checkpoint may set. A crop larger than the resized image
    /// (transformers then pads with zeros) is not covered.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.shortest_edge == 0 || self.crop_height == 0 || self.crop_width == 0 {
            return Err("shortest_edge and crop_size must be positive".into());
        }
        if self.crop_height > self.shortest_edge || self.crop_width > self.shortest_edge {
            return Err("a crop larger than shortest_edge (padding) is not covered".into());
        }
        if self.image_std.iter().any(|s| *s == 0.0 || !s.is_finite()) {
            return Err("image_std must be finite and non-zero".into());
        }
        Ok(())
    }

    /// `(height, width)` after the shortest-edge resize of a `width` x `height` image.
    pub fn resized_size(&self, width: u32, height: u32) -> Result<(u32, u32)> {
        if width == 0 || height == 0 {
            return Err(PreprocessError::ZeroSize { width, height });
        }
        let (short, long) = (width.min(height), width.max(height));
        let new_long = (u64::from(self.shortest_edge) * u64::from(long)) as f64 / f64::from(short);
        if new_long >= f64::from(u32::MAX) {
            return Err(PreprocessError::Unprocessable {
                message: format!("aspect ratio {long}:{short} is too extreme"),
            });
        }
        let (new_short, new_long) = (self.shortest_edge, new_long as u32);
        Ok(if width <= height {
            (new_long, new_short)
        } else {
            (new_short, new_long)
        })
    }

    /// Decodes and preprocesses one image.
    pub fn preprocess(
        &self,
        data: &[u8],
        allowed: &[ImageFormat],
        max_image_pixels: u64,
    ) -> Result<ClipOutput> {
        let image = decode_rgb(data, allowed, max_image_pixels)?;
        self.preprocess_rgb(&image)
    }

    /// Resizes, crops, normalizes and lays out a decoded image channel-first.
    pub fn preprocess_rgb(&self, image: &RgbImage) -> Result<ClipOutput> {
        let (rh, rw) = self.resized_size(image.width, image.height)?;
        let (w, h) = (rw as usize, rh as usize);
        let resized = resize(
            &image.data,
            image.width as usize,
            image.height as usize,
            3,
            w,
            h,
            self.filter,
        )?;
        let (ch, cw) = (self.crop_height as usize, self.crop_width as usize);
        let (top, left) = ((h - ch) / 2, (w - cw) / 2);
        let lut = normalization_lut(self.rescale_factor, &self.image_mean, &self.image_std);
        let mut out = reserve::<f32>(3 * ch * cw)?;
        for (c, table) in lut.iter().enumerate() {
            for y in top..top + ch {
                let row = &resized[(y * w + left) * 3 + c..(y * w + left + cw - 1) * 3 + c + 1];
                out.extend(row.iter().step_by(3).map(|&v| table[usize::from(v)]));
            }
        }
        Ok(ClipOutput {
            pixel_values: out,
            height: self.crop_height,
            width: self.crop_width,
        })
    }

    /// Preprocesses the images of one request in parallel (rayon's pool); results in
    /// input order, each image's own error in its slot.
    pub fn preprocess_many(
        &self,
        images: &[&[u8]],
        allowed: &[ImageFormat],
        max_image_pixels: u64,
    ) -> Vec<Result<ClipOutput>> {
        each_image(images, |data| {
            self.preprocess(data, allowed, max_image_pixels)
        })
    }
}
