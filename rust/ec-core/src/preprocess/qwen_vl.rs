//! The Qwen2-VL / Qwen2.5-VL image rule, as transformers' `Qwen2VLImageProcessor`
//! (PIL backend) computes it: `smart_resize` to multiples of `patch_size * merge_size`
//! within `[min_pixels, max_pixels]`, Pillow resampling, `x * rescale_factor` in
//! float64 then float32, `(x - mean) / std` in float32, and patches laid out as
//! `[grid_h * grid_w, 3 * temporal_patch_size * patch_size^2]` rows in merge-window
//! order (`gh, gw, mh, mw` rows; `c, t, ph, pw` columns), each frame repeated
//! `temporal_patch_size` times.
//!
//! Videos ([`QwenVlConfig::preprocess_video`]) follow transformers'
//! `Qwen2VLVideoProcessor` with the same kernels: every frame resized to the one
//! target size of the frame size (Pillow's resampling, frames in parallel), rescale
//! and normalize fused as transformers' video processors fuse them (which rounds
//! differently from the image rule's two steps), and `temporal_patch_size`
//! consecutive frames per temporal patch, the count padded by repeating the last
//! frame.

use super::resize::{avx2_dispatch, resize, Filter};
use super::{
    decode_rgb, each_image, fused_normalization_lut, normalization_lut, reserve, ImageFormat,
    PreprocessError, Result, RgbImage,
};

/// The checkpoint's `preprocessor_config.json` values the rule reads.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVlConfig {
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
    pub rescale_factor: f64,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub filter: Filter,
}

impl Default for QwenVlConfig {
    /// transformers' class defaults (OpenAI CLIP mean and std).
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            rescale_factor: 1.0 / 255.0,
            image_mean: [0.481_454_66, 0.457_827_5, 0.408_210_73],
            image_std: [0.268_629_54, 0.261_302_6, 0.275_777_1],
            filter: Filter::Bicubic,
        }
    }
}

/// One preprocessed image.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVlOutput {
    /// `[t * h * w, patch_dim]` row-major float32.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches.
    pub grid_thw: (u32, u32, u32),
    /// `3 * temporal_patch_size * patch_size^2`.
    pub patch_dim: usize,
}

/// transformers' `smart_resize`: `(height, width)` after resizing, each a multiple of
/// `factor`, the area within `[min_pixels, max_pixels]` (Python's float arithmetic and
/// round-half-to-even, to agree on every size).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32)> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if height == 0 || width == 0 {
        return Err(PreprocessError::ZeroSize { width, height });
    }
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(PreprocessError::Unprocessable {
            message: format!("absolute aspect ratio must be smaller than 200, got {ratio}"),
        });
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

impl QwenVlConfig {
    fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    /// Checks the values a checkpoint (or request) may set.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.patch_size == 0 || self.merge_size == 0 || self.temporal_patch_size == 0 {
            return Err("patch_size, merge_size and temporal_patch_size must be positive".into());
        }
        if self.min_pixels == 0 || self.min_pixels > self.max_pixels {
            return Err("min_pixels must be positive and at most max_pixels".into());
        }
        if self.image_std.iter().any(|s| *s == 0.0 || !s.is_finite()) {
            return Err("image_std must be finite and non-zero".into());
        }
        Ok(())
    }

    /// `(t, h, w)` of an image of `width` x `height` pixels, from its size alone.
    pub fn grid(&self, width: u32, height: u32) -> Result<(u32, u32, u32)> {
        let (rh, rw) = smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )?;
        Ok((1, rh / self.patch_size, rw / self.patch_size))
    }

    /// Placeholder tokens of an image of `width` x `height` pixels.
    pub fn num_tokens(&self, width: u32, height: u32) -> Result<usize> {
        let (t, h, w) = self.grid(width, height)?;
        Ok((t * h * w / (self.merge_size * self.merge_size)) as usize)
    }

    /// Decodes and preprocesses one image.
    pub fn preprocess(
        &self,
        data: &[u8],
        allowed: &[ImageFormat],
        max_image_pixels: u64,
    ) -> Result<QwenVlOutput> {
        let image = decode_rgb(data, allowed, max_image_pixels)?;
        self.preprocess_rgb(&image)
    }

    /// Resizes, normalizes and patchifies a decoded image.
    pub fn preprocess_rgb(&self, image: &RgbImage) -> Result<QwenVlOutput> {
        let (rh, rw) = smart_resize(
            image.height,
            image.width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )?;
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
        let p = self.patch_size as usize;
        let m = self.merge_size as usize;
        let t = self.temporal_patch_size as usize;
        let pixel_values = patchify(
            &resized,
            w,
            h,
            p,
            m,
            t,
            &normalization_lut(self.rescale_factor, &self.image_mean, &self.image_std),
        )?;
        let (gh, gw) = (h / p, w / p);
        let patch_dim = 3 * t * p * p;
        Ok(QwenVlOutput {
            pixel_values,
            grid_thw: (1, gh as u32, gw as u32),
            patch_dim,
        })
    }
}

/// `pixel_values` rows of a `w` x `h` RGB image (both multiples of `p * m`): merge
/// windows in raster order, their `m * m` patches in raster order; per patch, per
/// channel, the `p * p` normalized values `t` times (one temporal patch whose slots
/// all hold the image). Written in output order, so the buffer is filled once,
/// never zeroed first.
fn patchify(
    resized: &[u8],
    w: usize,
    h: usize,
    p: usize,
    m: usize,
    t: usize,
    lut: &[[f32; 256]; 3],
) -> Result<Vec<f32>> {
    let total = (h / p) * (w / p) * 3 * t * p * p;
    let mut out = reserve::<f32>(total)?;
    temporal_patch(
        &mut out.spare_capacity_mut()[..total],
        &vec![resized; t],
        w,
        h,
        p,
        m,
        lut,
    );
    // SAFETY: `temporal_patch` wrote all `total` values (`gh / m * gw / m * m * m`
    // patches of `3 * t * p * p` values).
    unsafe { out.set_len(total) };
    Ok(out)
}

/// `pixel_values` rows of `frames` (each a `w` x `h` RGB frame, both multiples of
/// `p * m`): temporal patch `g` holds frames `g * t .. g * t + t` (the last frame
/// repeated past the end); within it the rows and columns of [`patchify`], each
/// temporal slot from its own frame. Temporal patches are written in parallel, each
/// into its own part of the output, once, in order.
fn patchify_frames(
    frames: &[&[u8]],
    w: usize,
    h: usize,
    p: usize,
    m: usize,
    t: usize,
    lut: &[[f32; 256]; 3],
) -> Result<(Vec<f32>, usize)> {
    use rayon::prelude::*;
    let groups = frames.len().div_ceil(t);
    let per_group = (h / p) * (w / p) * 3 * t * p * p;
    let total = groups * per_group;
    let mut out = reserve::<f32>(total)?;
    out.spare_capacity_mut()[..total]
        .par_chunks_mut(per_group)
        .enumerate()
        .for_each(|(g, chunk)| {
            let slots: Vec<&[u8]> = (0..t)
                .map(|k| frames[(g * t + k).min(frames.len() - 1)])
                .collect();
            temporal_patch(chunk, &slots, w, h, p, m, lut);
        });
    // SAFETY: every chunk of `per_group` values was written in full by `temporal_patch`
    // (its loops write `gh / m * gw / m * m * m` patches of `3 * t * p * p` values).
    unsafe { out.set_len(total) };
    Ok((out, groups))
}

avx2_dispatch! {
    /// One temporal patch of [`patchify_frames`]: `slots[k]` is the frame of temporal
    /// slot `k`; a slot holding the same frame as the one before it (the padding) is
    /// copied rather than looked up again.
    fn temporal_patch(
        chunk: &mut [std::mem::MaybeUninit<f32>],
        slots: &[&[u8]],
        w: usize,
        h: usize,
        p: usize,
        m: usize,
        lut: &[[f32; 256]; 3],
    ) -> () {
        let (gh, gw) = (h / p, w / p);
        let frame = p * p;
        let t = slots.len();
        let mut at = 0usize;
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let y0 = (bh * m + mh) * p;
                        let x0 = (bw * m + mw) * p;
                        for (c, table) in lut.iter().enumerate() {
                            for k in 0..t {
                                let (done, rest) = chunk[at..at + (k + 1) * frame]
                                    .split_at_mut(k * frame);
                                if k > 0 && std::ptr::eq(slots[k], slots[k - 1]) {
                                    rest.copy_from_slice(&done[(k - 1) * frame..]);
                                    continue;
                                }
                                let src_frame = slots[k];
                                for (ph, line) in rest.chunks_exact_mut(p).enumerate() {
                                    let start = ((y0 + ph) * w + x0) * 3 + c;
                                    let src = &src_frame[start..start + (p - 1) * 3 + 1];
                                    for (pw, o) in line.iter_mut().enumerate() {
                                        o.write(table[usize::from(src[pw * 3])]);
                                    }
                                }
                            }
                            at += t * frame;
                        }
                    }
                }
            }
        }
        debug_assert_eq!(at, chunk.len());
    }
}

impl QwenVlConfig {
    /// `pixel_values` and `(t, h, w)` of a video: `count` RGB frames of `width` x
    /// `height`, one after the other in `frames` (`count * height * width * 3` bytes).
    /// One target size for every frame (`smart_resize` of the frame size); frames
    /// already at that size are read as they are, others are resized in parallel;
    /// values are normalized as transformers' video processors do (rescale fused into
    /// mean and std); the frame count is padded to a multiple of `temporal_patch_size` with the last
    /// frame.
    pub fn preprocess_video(
        &self,
        frames: &[u8],
        count: usize,
        width: u32,
        height: u32,
    ) -> Result<QwenVlOutput> {
        use rayon::prelude::*;
        let frame_bytes = width as usize * height as usize * 3;
        if count == 0 || frame_bytes == 0 {
            return Err(PreprocessError::ZeroSize { width, height });
        }
        if frames.len() != count * frame_bytes {
            return Err(PreprocessError::Corrupt {
                message: format!(
                    "{} bytes of frames for {count} frames of {width}x{height}",
                    frames.len()
                ),
            });
        }
        let (rh, rw) = smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )?;
        let (w, h) = (rw as usize, rh as usize);
        let sources: Vec<&[u8]> = frames.chunks_exact(frame_bytes).collect();
        let resized: Vec<Vec<u8>> = if (w, h) == (width as usize, height as usize) {
            Vec::new()
        } else {
            sources
                .par_iter()
                .map(|f| resize(f, width as usize, height as usize, 3, w, h, self.filter))
                .collect::<Result<_>>()?
        };
        let inputs: Vec<&[u8]> = if resized.is_empty() {
            sources
        } else {
            resized.iter().map(Vec::as_slice).collect()
        };
        let p = self.patch_size as usize;
        let m = self.merge_size as usize;
        let t = self.temporal_patch_size as usize;
        let lut = fused_normalization_lut(self.rescale_factor, &self.image_mean, &self.image_std);
        let (pixel_values, groups) = patchify_frames(&inputs, w, h, p, m, t, &lut)?;
        Ok(QwenVlOutput {
            pixel_values,
            grid_thw: (groups as u32, (h / p) as u32, (w / p) as u32),
            patch_dim: 3 * t * p * p,
        })
    }

    /// Preprocesses the images of one request in parallel (rayon's pool); results in
    /// input order, each image's own error in its slot.
    pub fn preprocess_many(
        &self,
        images: &[&[u8]],
        allowed: &[ImageFormat],
        max_image_pixels: u64,
    ) -> Vec<Result<QwenVlOutput>> {
        each_image(images, |data| {
            self.preprocess(data, allowed, max_image_pixels)
        })
    }
}
