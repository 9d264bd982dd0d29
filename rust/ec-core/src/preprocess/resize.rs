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
///
/// The same weights again with one span for every output pixel: `span` taps from
/// `starts[i]`, `padded` holding zeros where Pillow's window is narrower (a zero weight
/// adds nothing, so sums are unchanged), which gives the kernels a uniform inner loop.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
    span: usize,
    starts: Vec<usize>,
    padded: Vec<i32>,
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
    let span = ksize.min(in_size);
    let mut starts = Vec::with_capacity(out_size);
    let mut padded = vec![0i32; out_size * span];
    for (xx, &(xmin, taps)) in bounds.iter().enumerate() {
        let start = xmin.min(in_size - span);
        let shift = xmin - start;
        padded[xx * span + shift..xx * span + shift + taps]
            .copy_from_slice(&weights[xx * ksize..xx * ksize + taps]);
        starts.push(start);
    }
    Coeffs {
        ksize,
        bounds,
        weights,
        span,
        starts,
        padded,
    }
}

#[inline(always)]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const ROUND: i32 = 1 << (PRECISION_BITS - 1);

/// Defines the function `$name` whose body runs compiled for AVX2 when the CPU has it
/// (detected at run time) and for the build's baseline otherwise. Bodies are plain Rust
/// that the compiler vectorizes; integer and IEEE arithmetic give identical results
/// either way.
macro_rules! avx2_dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn with_avx2($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above).
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use avx2_dispatch;

/// How the horizontal pass computes a row; all give the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowKernel {
    /// Any number of channels, one channel at a time over Pillow's own window.
    Generic,
    /// Three channels, each pixel widened to four i32 lanes: every tap is one
    /// multiply-add of a small array the compiler vectorizes.
    Wide3,
    /// Three channels with SSE4.1 intrinsics (x86-64).
    #[cfg(target_arch = "x86_64")]
    Sse41x3,
    /// Three channels with AVX2 intrinsics, eight rows at a time (x86-64); the rows
    /// left over after the last block of eight go through [`RowKernel::Sse41x3`].
    #[cfg(target_arch = "x86_64")]
    Avx2Rows8,
}

impl RowKernel {
    fn best(channels: usize) -> Self {
        if channels != 3 {
            return Self::Generic;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                return Self::Avx2Rows8;
            }
            if std::is_x86_feature_detected!("sse4.1") {
                return Self::Sse41x3;
            }
        }
        Self::Wide3
    }
}

fn row_generic(line: &[u8], channels: usize, c: &Coeffs, dst: &mut [u8]) {
    for (xx, &(xmin, taps)) in c.bounds.iter().enumerate() {
        let k = &c.weights[xx * c.ksize..xx * c.ksize + taps];
        let px = &line[xmin * channels..(xmin + taps) * channels];
        for ch in 0..channels {
            let mut s = ROUND;
            for (p, &w) in px.chunks_exact(channels).zip(k) {
                s += i32::from(p[ch]) * w;
            }
            dst[xx * channels + ch] = clip8(s);
        }
    }
}

#[inline(always)]
fn row_wide3(line: &[u8], wide: &mut [[i32; 4]], c: &Coeffs, dst: &mut [u8]) {
    for (d, p) in wide.iter_mut().zip(line.chunks_exact(3)) {
        *d = [i32::from(p[0]), i32::from(p[1]), i32::from(p[2]), 0];
    }
    let span = c.span;
    for ((px, &start), k) in dst
        .chunks_exact_mut(3)
        .zip(&c.starts)
        .zip(c.padded.chunks_exact(span))
    {
        let mut acc = [ROUND; 4];
        for (p, &w) in wide[start..start + span].iter().zip(k) {
            for (a, &v) in acc.iter_mut().zip(p) {
                *a += v * w;
            }
        }
        px[0] = clip8(acc[0]);
        px[1] = clip8(acc[1]);
        px[2] = clip8(acc[2]);
    }
}

/// The horizontal pass of one resize: its weights and the scratch rows of its kernels,
/// kept across the bands of rows it is run over.
struct Horizontal<'a> {
    in_width: usize,
    channels: usize,
    c: &'a Coeffs,
    out_width: usize,
    kernel: RowKernel,
    wide: Vec<[i32; 4]>,
    padded: Vec<u8>,
    columns: Vec<u32>,
}

impl<'a> Horizontal<'a> {
    fn new(
        in_width: usize,
        channels: usize,
        c: &'a Coeffs,
        out_width: usize,
        kernel: RowKernel,
    ) -> Result<Self> {
        // The x86 kernels' bound on their loads, checked once here rather than per row.
        assert!(
            c.starts.iter().all(|&s| s + c.span <= in_width),
            "resampling windows must lie inside the row"
        );
        #[cfg(target_arch = "x86_64")]
        let eight = kernel == RowKernel::Avx2Rows8;
        #[cfg(not(target_arch = "x86_64"))]
        let eight = false;
        Ok(Self {
            in_width,
            channels,
            c,
            out_width,
            kernel,
            wide: alloc(if kernel == RowKernel::Wide3 {
                in_width
            } else {
                0
            })?,
            // The row plus one byte: the SSE4.1 kernel loads four bytes per pixel.
            padded: alloc(in_width * channels + 1)?,
            columns: alloc(if eight { in_width * 8 } else { 0 })?,
        })
    }

    /// Rows `rows` of `src` into `out` (`rows.len()` output rows).
    fn run(&mut self, src: &[u8], rows: std::ops::Range<usize>, out: &mut [u8]) {
        horizontal_rows(self, src, rows, out);
    }
}

avx2_dispatch! {
    /// The horizontal pass over `rows` of `src` (`h.in_width` pixels each) into `out`.
    fn horizontal_rows(
        h: &mut Horizontal<'_>,
        src: &[u8],
        rows: std::ops::Range<usize>,
        out: &mut [u8],
    ) -> () {
        let (channels, c) = (h.channels, h.c);
        let stride = h.in_width * channels;
        let out_stride = h.out_width * channels;
        let (mut rows, mut kernel) = (rows, h.kernel);
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if kernel == RowKernel::Avx2Rows8 {
            let blocks = rows.len() / 8;
            for b in 0..blocks {
                let first = rows.start + 8 * b;
                let lines = &src[first * stride..(first + 8) * stride];
                let dst = &mut out[8 * b * out_stride..8 * (b + 1) * out_stride];
                // SAFETY: this kernel is chosen only where AVX2 is present.
                unsafe { x86::horizontal3_rows8(lines, h.in_width, &mut h.columns, c, dst) };
            }
            rows = rows.start + 8 * blocks..rows.end;
            done = 8 * blocks * out_stride;
            kernel = RowKernel::Sse41x3;
        }
        let out = &mut out[done..];
        for (oy, y) in rows.enumerate() {
            let line = &src[y * stride..(y + 1) * stride];
            let dst = &mut out[oy * out_stride..(oy + 1) * out_stride];
            match kernel {
                RowKernel::Generic => row_generic(line, channels, c, dst),
                RowKernel::Wide3 => row_wide3(line, &mut h.wide, c, dst),
                #[cfg(target_arch = "x86_64")]
                RowKernel::Sse41x3 => {
                    h.padded[..stride].copy_from_slice(line);
                    // SAFETY: the kernel is chosen only where SSE4.1 is present.
                    unsafe { x86::horizontal3(&h.padded, c, dst) };
                }
                #[cfg(target_arch = "x86_64")]
                RowKernel::Avx2Rows8 => unreachable!("handled in blocks above"),
            }
        }
    }
}

/// The horizontal pass over `rows` of `src` (`in_width` pixels each), in a new buffer.
fn horizontal(
    src: &[u8],
    in_width: usize,
    rows: std::ops::Range<usize>,
    channels: usize,
    c: &Coeffs,
    out_width: usize,
    kernel: RowKernel,
) -> Result<Vec<u8>> {
    let mut out = alloc::<u8>(rows.len() * out_width * channels)?;
    Horizontal::new(in_width, channels, c, out_width, kernel)?.run(src, rows, &mut out);
    Ok(out)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Coeffs, PRECISION_BITS, ROUND};
    use std::arch::x86_64::*;

    /// One row of the 3-channel horizontal pass: per output pixel, the three channels
    /// (and a fourth, discarded lane) of each tap widened to i32 and multiply-added in
    /// one register, then shifted, clamped to 0..=255 by saturating packs, and stored.
    ///
    /// # Safety
    /// The CPU has SSE4.1; `line` is the input row plus at least one byte more (the
    /// fourth lane of the last pixel's load); `dst` holds `c.starts.len()` pixels; every
    /// window `c.starts[i] .. c.starts[i] + c.span` lies within the row (as
    /// `Horizontal::new` checks).
    #[target_feature(enable = "sse4.1")]
    pub(super) unsafe fn horizontal3(line: &[u8], c: &Coeffs, dst: &mut [u8]) {
        let span = c.span;
        let n = c.starts.len();
        assert!(dst.len() >= n * 3);
        debug_assert!(c.starts.iter().all(|&s| (s + span) * 3 < line.len()));
        let round = _mm_set1_epi32(ROUND);
        for (xx, (&start, k)) in c.starts.iter().zip(c.padded.chunks_exact(span)).enumerate() {
            let base = line.as_ptr().add(start * 3);
            let mut acc = round;
            for (t, &w) in k.iter().enumerate() {
                let four = (base.add(t * 3) as *const i32).read_unaligned();
                let px = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
                acc = _mm_add_epi32(acc, _mm_mullo_epi32(px, _mm_set1_epi32(w)));
            }
            let shifted = _mm_srai_epi32::<{ PRECISION_BITS as i32 }>(acc);
            let packed = _mm_packus_epi16(_mm_packs_epi32(shifted, shifted), round);
            let bytes = _mm_cvtsi128_si32(packed).to_le_bytes();
            dst[xx * 3..xx * 3 + 3].copy_from_slice(&bytes[..3]);
        }
    }

    /// Eight rows of the 3-channel horizontal pass at once. The rows are first laid out
    /// column by column (`columns[x * 8 + r]`: row `r`'s pixel `x` as R, G, B, 0), so
    /// that one tap of one output pixel is the same weight for 32 lanes: four
    /// multiply-adds of eight i32 lanes (two rows each) per tap, against one of four
    /// lanes (three used) row by row. Sums, shift and clamping are the other kernels'.
    ///
    /// # Safety
    /// The CPU has AVX2; `lines` holds 8 rows of `in_width` RGB pixels, `columns`
    /// `in_width * 8` values, `dst` 8 rows of `c.starts.len()` RGB pixels, and every
    /// window `c.starts[i] .. c.starts[i] + c.span` lies within `in_width` (as
    /// `Horizontal::new` checks).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn horizontal3_rows8(
        lines: &[u8],
        in_width: usize,
        columns: &mut [u32],
        c: &Coeffs,
        dst: &mut [u8],
    ) {
        let (span, n) = (c.span, c.starts.len());
        let stride = in_width * 3;
        assert!(lines.len() >= 8 * stride && columns.len() >= 8 * in_width);
        assert!(dst.len() >= 8 * n * 3 && n > 0);
        debug_assert!(c.starts.iter().all(|&s| s + span <= in_width));
        for r in 0..8 {
            let line = &lines[r * stride..(r + 1) * stride];
            for (x, px) in line.chunks_exact(3).enumerate() {
                columns[x * 8 + r] = u32::from_le_bytes([px[0], px[1], px[2], 0]);
            }
        }
        let round = _mm256_set1_epi32(ROUND);
        let base = columns.as_ptr() as *const u8;
        let out = dst.as_mut_ptr();
        let row_bytes = n * 3;
        // Row order of the packed result's eight 32-bit lanes (see below).
        const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
        let mut lanes = [0u32; 8];
        for (xx, (&start, k)) in c.starts.iter().zip(c.padded.chunks_exact(span)).enumerate() {
            let mut acc = [round; 4];
            for (t, &w) in k.iter().enumerate() {
                let w = _mm256_set1_epi32(w);
                let at = base.add((start + t) * 32);
                for (j, a) in acc.iter_mut().enumerate() {
                    // Rows 2j and 2j+1: two pixels of four bytes, widened to eight lanes.
                    let two = _mm_loadl_epi64(at.add(8 * j) as *const __m128i);
                    *a = _mm256_add_epi32(*a, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(two), w));
                }
            }
            const BITS: i32 = PRECISION_BITS as i32;
            let a0 = _mm256_srai_epi32::<BITS>(acc[0]);
            let a1 = _mm256_srai_epi32::<BITS>(acc[1]);
            let a2 = _mm256_srai_epi32::<BITS>(acc[2]);
            let a3 = _mm256_srai_epi32::<BITS>(acc[3]);
            // Within each 128-bit half, packs interleave their two inputs: the low half
            // ends up with rows 0, 2, 4, 6 and the high half with rows 1, 3, 5, 7.
            let lo = _mm256_packs_epi32(a0, a1);
            let hi = _mm256_packs_epi32(a2, a3);
            let bytes = _mm256_packus_epi16(lo, hi);
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, bytes);
            for (lane, &row) in ORDER.iter().enumerate() {
                let p = out.add(row * row_bytes + xx * 3);
                let px = lanes[lane].to_le_bytes();
                if xx + 1 < n {
                    // Four bytes: the fourth is the next pixel's first, written next.
                    (p as *mut [u8; 4]).write_unaligned(px);
                } else {
                    std::ptr::copy_nonoverlapping(px.as_ptr(), p, 3);
                }
            }
        }
    }
}

/// Columns accumulated in registers at once by the vertical pass.
const LANES: usize = 32;

avx2_dispatch! {
    /// The vertical pass: output rows `yys` into `out`, from `src` holding the input
    /// rows from `first_row` on.
    fn vertical_rows(
        src: &[u8],
        row_len: usize,
        c: &Coeffs,
        first_row: usize,
        yys: std::ops::Range<usize>,
        out: &mut [u8],
    ) -> () {
        let first_out = yys.start;
        for yy in yys {
            let (ymin, taps) = c.bounds[yy];
            let k = &c.weights[yy * c.ksize..yy * c.ksize + taps];
            let base = (ymin - first_row) * row_len;
            let dst = &mut out[(yy - first_out) * row_len..(yy - first_out + 1) * row_len];
            let mut x = 0;
            while x + LANES <= row_len {
                let mut acc = [ROUND; LANES];
                for (t, &w) in k.iter().enumerate() {
                    let at = base + t * row_len + x;
                    let line: &[u8; LANES] = src[at..at + LANES].try_into().expect("lanes");
                    for (a, &p) in acc.iter_mut().zip(line) {
                        *a += i32::from(p) * w;
                    }
                }
                for (o, &a) in dst[x..x + LANES].iter_mut().zip(&acc) {
                    *o = clip8(a);
                }
                x += LANES;
            }
            for (xi, o) in dst.iter_mut().enumerate().skip(x) {
                let mut a = ROUND;
                for (t, &w) in k.iter().enumerate() {
                    a += i32::from(src[base + t * row_len + xi]) * w;
                }
                *o = clip8(a);
            }
        }
    }
}

/// The vertical pass over every output row, in a new buffer.
fn vertical(src: &[u8], row_len: usize, c: &Coeffs, first_row: usize) -> Result<Vec<u8>> {
    let mut out = alloc::<u8>(c.bounds.len() * row_len)?;
    vertical_rows(src, row_len, c, first_row, 0..c.bounds.len(), &mut out);
    Ok(out)
}

/// Output rows per band of [`horizontal_then_vertical`].
const BAND: usize = 32;

/// The horizontal pass, then the vertical one, band by band: for each [`BAND`] output
/// rows, the horizontal pass fills in the input rows their windows reach that the band
/// buffer does not hold yet (windows of neighbouring rows overlap, so those already
/// there move to its front), then the vertical pass reads them there. Each input row
/// goes through the horizontal pass once, as in one pass over all rows, and the rows
/// in between stay in cache instead of making a second image-sized buffer.
fn horizontal_then_vertical(
    src: &[u8],
    in_w: usize,
    channels: usize,
    horiz: &Coeffs,
    vert: &Coeffs,
    out_w: usize,
) -> Result<Vec<u8>> {
    let row_len = out_w * channels;
    let out_h = vert.bounds.len();
    let window = |y0: usize, y1: usize| {
        let (last, taps) = vert.bounds[y1 - 1];
        (vert.bounds[y0].0, last + taps)
    };
    let bands = || {
        (0..out_h)
            .step_by(BAND)
            .map(|y0| (y0, (y0 + BAND).min(out_h)))
    };
    let most = bands()
        .map(|(y0, y1)| {
            let (a, b) = window(y0, y1);
            b - a
        })
        .max()
        .unwrap_or(0);
    let mut band = alloc::<u8>(most * row_len)?;
    let mut out = alloc::<u8>(out_h * row_len)?;
    let mut h = Horizontal::new(in_w, channels, horiz, out_w, RowKernel::best(channels))?;
    // Input rows `lo..hi` are in `band`, from its start.
    let (mut lo, mut hi) = (0, 0);
    for (y0, y1) in bands() {
        let (a, b) = window(y0, y1);
        if a < hi {
            band.copy_within((a - lo) * row_len..(hi - lo) * row_len, 0);
        } else {
            hi = a;
        }
        lo = a;
        h.run(
            src,
            hi..b,
            &mut band[(hi - lo) * row_len..(b - lo) * row_len],
        );
        hi = b;
        let dst = &mut out[y0 * row_len..y1 * row_len];
        vertical_rows(&band[..(b - lo) * row_len], row_len, vert, lo, y0..y1, dst);
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
            RowKernel::best(channels),
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
                RowKernel::best(channels),
            )
        }
        (true, true) => horizontal_then_vertical(
            src,
            in_w,
            channels,
            &coeffs(in_w, out_w, filter),
            &coeffs(in_h, out_h, filter),
            out_w,
        ),
    }
}

/// Pillow's choice of pass order: vertical first when `in_h - out_h > 2 * (in_w - out_w)`
/// and the height shrinks.
fn vertical_first(in_w: usize, in_h: usize, out_w: usize, out_h: usize) -> bool {
    let dh = in_h as i64 - out_h as i64;
    let dw = in_w as i64 - out_w as i64;
    dh > 0 && dh > 2 * dw
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes (a 64-bit LCG's high bits).
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 56) as u8
            })
            .collect()
    }

    /// Every row kernel the CPU runs gives the generic kernel's bytes, for widths that
    /// shrink, grow, stay, and windows clipped at both edges.
    #[test]
    fn row_kernels_agree() {
        let mut kernels = vec![RowKernel::Wide3];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("sse4.1") {
            kernels.push(RowKernel::Sse41x3);
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            kernels.push(RowKernel::Avx2Rows8);
        }
        let sizes = [
            (1, 1),
            (1, 7),
            (2, 1),
            (5, 3),
            (7, 28),
            (640, 1288),
            (1288, 640),
            (3000, 56),
        ];
        for (seed, &(in_w, out_w)) in sizes.iter().enumerate() {
            // Rows 1..20 of 21: two blocks of eight and three left over.
            let rows = 1..20;
            let src = noise(in_w * 21 * 3, seed as u64);
            for filter in [Filter::Bicubic, Filter::Bilinear] {
                let c = coeffs(in_w, out_w, filter);
                let want =
                    horizontal(&src, in_w, rows.clone(), 3, &c, out_w, RowKernel::Generic).unwrap();
                for &kernel in &kernels {
                    let got = horizontal(&src, in_w, rows.clone(), 3, &c, out_w, kernel).unwrap();
                    assert_eq!(got, want, "{kernel:?} {in_w}->{out_w} {filter:?}");
                }
            }
        }
    }

    /// The banded passes give the bytes of one horizontal pass over every row the
    /// vertical pass reads followed by one vertical pass: sizes that grow, shrink a
    /// little and a lot (windows of many rows), bands that end mid-image and exactly.
    #[test]
    fn bands_agree_with_whole_passes() {
        let sizes = [
            (5, 3, 7, 9),
            (1280, 720, 1288, 728),
            (300, 97, 280, 64),
            (64, 1000, 60, 101),
            (40, 64, 48, 2 * BAND),
            (33, 3000, 41, 56),
        ];
        for (seed, &(in_w, in_h, out_w, out_h)) in sizes.iter().enumerate() {
            let src = noise(in_w * in_h * 3, seed as u64 + 40);
            for filter in [Filter::Bicubic, Filter::Bilinear] {
                let (horiz, vert) = (coeffs(in_w, out_w, filter), coeffs(in_h, out_h, filter));
                let first = vert.bounds[0].0;
                let last = vert.bounds.last().map(|&(y, taps)| y + taps).unwrap();
                let kernel = RowKernel::best(3);
                let tmp = horizontal(&src, in_w, first..last, 3, &horiz, out_w, kernel).unwrap();
                let want = vertical(&tmp, out_w * 3, &vert, first).unwrap();
                let got = horizontal_then_vertical(&src, in_w, 3, &horiz, &vert, out_w).unwrap();
                assert_eq!(got, want, "{in_w}x{in_h} -> {out_w}x{out_h} {filter:?}");
            }
        }
    }

    /// The vertical pass's register blocks and their scalar tail give the bytes of a
    /// plain per-column sum over Pillow's window.
    #[test]
    fn vertical_blocks_agree_with_plain_sums() {
        for (seed, &(row_len, in_h, out_h)) in
            [(3, 5, 9), (33, 40, 17), (100, 720, 728), (64, 2, 1)]
                .iter()
                .enumerate()
        {
            let src = noise(row_len * in_h, seed as u64 + 10);
            let c = coeffs(in_h, out_h, Filter::Bicubic);
            let got = vertical(&src, row_len, &c, 0).unwrap();
            for (yy, &(ymin, taps)) in c.bounds.iter().enumerate() {
                for x in 0..row_len {
                    let mut acc = ROUND;
                    for t in 0..taps {
                        acc +=
                            i32::from(src[(ymin + t) * row_len + x]) * c.weights[yy * c.ksize + t];
                    }
                    assert_eq!(
                        got[yy * row_len + x],
                        clip8(acc),
                        "{row_len} {in_h}->{out_h}"
                    );
                }
            }
        }
    }
}
