//! Pillow's resampling (`Image.resize` with a convolution filter), reproduced to the
//! bit: the same kernel support, the same double-precision weights normalised per
//! output pixel, the same conversion to 22-bit fixed point, the same horizontal pass
//! over only the rows the vertical pass reads, and the same rounding and clipping.
//! Channels are interleaved (`channels` bytes per pixel) and independent.

use super::{alloc, Result};

/// A resampling filter of Pillow's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// `Image.BILINEAR` (triangle, support 1).
    Bilinear,
    /// `Image.BICUBIC` (Keys cubic with a = -0.5, support 2).
    Bicubic,
}

impl Filter {
    /// The filter with Pillow's `Resampling` number (2 bilinear, 3 bicubic).
    pub fn from_pillow(value: i64) -> Option<Self> {
        match value {
            2 => Some(Self::Bilinear),
            3 => Some(Self::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            Self::Bilinear => 1.0,
            Self::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Self::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Self::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Per output pixel: the first input index, the number of taps, and `ksize` fixed-point
/// weights (`ksize` is the same for every output pixel of one axis).
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize, filter: Filter) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // Pillow truncates toward zero (a C cast), then clamps.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let taps = xmax.saturating_sub(xmin);
        let mut total = 0.0;
        for (x, slot) in k.iter_mut().enumerate().take(taps) {
            let w = filter.weight((x as f64 + xmin as f64 - center + 0.5) * ss);
            *slot = w;
            total += w;
        }
        let row = &mut weights[xx * ksize..(xx + 1) * ksize];
        for (x, out) in row.iter_mut().enumerate().take(taps) {
            let w = if total != 0.0 { k[x] / total } else { k[x] };
            let scaled = w * f64::from(1u32 << PRECISION_BITS);
            *out = if w < 0.0 {
                (scaled - 0.5) as i32
            } else {
                (scaled + 0.5) as i32
            };
        }
        bounds.push((xmin, taps));
    }
    Coeffs {
        ksize,
        bounds,
        weights,
    }
}

#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const ROUND: i32 = 1 << (PRECISION_BITS - 1);

fn horizontal(
    src: &[u8],
    in_width: usize,
    rows: std::ops::Range<usize>,
    channels: usize,
    c: &Coeffs,
    out_width: usize,
) -> Result<Vec<u8>> {
    let mut out = alloc::<u8>(rows.len() * out_width * channels)?;
    for (oy, y) in rows.enumerate() {
        let line = &src[y * in_width * channels..(y + 1) * in_width * channels];
        let dst = &mut out[oy * out_width * channels..(oy + 1) * out_width * channels];
        for (xx, &(xmin, taps)) in c.bounds.iter().enumerate() {
            let k = &c.weights[xx * c.ksize..xx * c.ksize + taps];
            let px = &line[xmin * channels..(xmin + taps) * channels];
            if channels == 3 {
                let (mut s0, mut s1, mut s2) = (ROUND, ROUND, ROUND);
                for (p, &w) in px.chunks_exact(3).zip(k) {
                    s0 += i32::from(p[0]) * w;
                    s1 += i32::from(p[1]) * w;
                    s2 += i32::from(p[2]) * w;
                }
                dst[xx * 3] = clip8(s0);
                dst[xx * 3 + 1] = clip8(s1);
                dst[xx * 3 + 2] = clip8(s2);
            } else {
                for ch in 0..channels {
                    let mut s = ROUND;
                    for (p, &w) in px.chunks_exact(channels).zip(k) {
                        s += i32::from(p[ch]) * w;
                    }
                    dst[xx * channels + ch] = clip8(s);
                }
            }
        }
    }
    Ok(out)
}

fn vertical(src: &[u8], row_len: usize, c: &Coeffs, first_row: usize) -> Result<Vec<u8>> {
    let mut out = alloc::<u8>(c.bounds.len() * row_len)?;
    let mut acc = alloc::<i32>(row_len)?;
    for (yy, &(ymin, taps)) in c.bounds.iter().enumerate() {
        let k = &c.weights[yy * c.ksize..yy * c.ksize + taps];
        acc.fill(ROUND);
        for (t, &w) in k.iter().enumerate() {
            let y = ymin + t - first_row;
            let line = &src[y * row_len..(y + 1) * row_len];
            for (a, &p) in acc.iter_mut().zip(line) {
                *a += i32::from(p) * w;
            }
        }
        for (o, &a) in out[yy * row_len..(yy + 1) * row_len].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    Ok(out)
}

/// Resizes an interleaved 8-bit image of `channels` channels from `in_w`x`in_h` to
/// `out_w`x`out_h`, as Pillow's `Image.resize(..., resample=filter)` does.
///
/// The pass order is Pillow's (13.0): horizontal first (over only the rows the vertical
/// pass reads), except when the height shrinks by more than twice as many pixels as the
/// width does, where the vertical pass runs first. Rounding to 8 bits between the passes
/// makes the order visible in the output.
pub fn resize(
    src: &[u8],
    in_w: usize,
    in_h: usize,
    channels: usize,
    out_w: usize,
    out_h: usize,
    filter: Filter,
) -> Result<Vec<u8>> {
    debug_assert_eq!(src.len(), in_w * in_h * channels);
    let need_h = out_w != in_w;
    let need_v = out_h != in_h;
    match (need_h, need_v) {
        (false, false) => {
            let mut copy = alloc::<u8>(src.len())?;
            copy.copy_from_slice(src);
            Ok(copy)
        }
        (true, false) => horizontal(
            src,
            in_w,
            0..in_h,
            channels,
            &coeffs(in_w, out_w, filter),
            out_w,
        ),
        (false, true) => vertical(src, in_w * channels, &coeffs(in_h, out_h, filter), 0),
        (true, true) if vertical_first(in_w, in_h, out_w, out_h) => {
            let tmp = vertical(src, in_w * channels, &coeffs(in_h, out_h, filter), 0)?;
            horizontal(
                &tmp,
                in_w,
                0..out_h,
                channels,
                &coeffs(in_w, out_w, filter),
                out_w,
            )
        }
        (true, true) => {
            let vert = coeffs(in_h, out_h, filter);
            let first = vert.bounds.first().map_or(0, |b| b.0);
            let last = vert.bounds.last().map_or(in_h, |b| b.0 + b.1);
            let horiz = coeffs(in_w, out_w, filter);
            let tmp = horizontal(src, in_w, first..last, channels, &horiz, out_w)?;
            vertical(&tmp, out_w * channels, &vert, first)
        }
    }
}

/// Pillow's choice of pass order: vertical first when `in_h - out_h > 2 * (in_w - out_w)`
/// and the height shrinks.
fn vertical_first(in_w: usize, in_h: usize, out_w: usize, out_h: usize) -> bool {
    let dh = in_h as i64 - out_h as i64;
    let dw = in_w as i64 - out_w as i64;
    dh > 0 && dh > 2 * dw
}
