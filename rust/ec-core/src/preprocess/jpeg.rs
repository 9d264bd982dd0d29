//! JPEG through libjpeg-turbo's decoder (the `mozjpeg` build of it, compiled from
//! source), with Pillow's defaults: integer (ISLOW) IDCT and fancy upsampling. That is
//! the decoder Pillow links, so decoded pixels are bit-identical to Pillow's; pure-Rust
//! decoders differ by a few levels, which normalization turns into ~0.05.
//!
//! libjpeg reports fatal errors by unwinding out of its error handler; every call into
//! it is wrapped in `catch_unwind`. A premature end of data is only a warning there
//! (libjpeg pads the scan); Pillow refuses such a file as truncated, and so do we.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use mozjpeg::{ColorSpace, Decompress};
use mozjpeg_sys::{jpeg_common_struct, jpeg_error_mgr, jpeg_std_error};

use super::decode::RgbImage;
use super::{reserve, PreprocessError, Result};

thread_local! {
    /// Set by [`emit_message`] when libjpeg hit the end of the data early.
    static HIT_EOF: Cell<bool> = const { Cell::new(false) };
}

/// libjpeg's `JWRN_JPEG_EOF` message code.
const JWRN_JPEG_EOF: i32 = mozjpeg_sys::JWRN_JPEG_EOF;

extern "C-unwind" fn emit_message(cinfo: &mut jpeg_common_struct, level: std::os::raw::c_int) {
    // SAFETY: libjpeg calls this with its own valid `cinfo`, whose `err` is set.
    let code = unsafe { cinfo.err.as_ref().map_or(0, |e| e.msg_code) };
    if level < 0 && code == JWRN_JPEG_EOF {
        HIT_EOF.with(|f| f.set(true));
    }
}

extern "C-unwind" fn error_exit(cinfo: &mut jpeg_common_struct) {
    let mut buffer = [0u8; 80];
    // SAFETY: as above; `format_message` writes at most JMSG_LENGTH_MAX (80) bytes.
    let message = unsafe {
        match cinfo.err.as_ref().and_then(|e| e.format_message) {
            Some(format) => {
                let format: unsafe extern "C-unwind" fn(&mut jpeg_common_struct, &mut [u8; 80]) =
                    std::mem::transmute(format);
                format(cinfo, &mut buffer);
                let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
                String::from_utf8_lossy(&buffer[..end]).into_owned()
            }
            None => "libjpeg error".to_owned(),
        }
    };
    std::panic::resume_unwind(Box::new(message));
}

fn error_mgr() -> jpeg_error_mgr {
    // SAFETY: `jpeg_std_error` fills every field of a zeroed manager.
    let mut err: jpeg_error_mgr = unsafe { std::mem::zeroed() };
    unsafe { jpeg_std_error(&mut err) };
    err.error_exit = Some(error_exit);
    err.emit_message = Some(emit_message);
    err
}

fn guarded<T>(f: impl FnOnce() -> std::io::Result<T>) -> Result<T> {
    HIT_EOF.with(|flag| flag.set(false));
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let eof = HIT_EOF.with(|flag| flag.replace(false));
    match outcome {
        Ok(Ok(_)) if eof => Err(PreprocessError::Truncated),
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(PreprocessError::Corrupt {
            message: e.to_string(),
        }),
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "libjpeg error".to_owned());
            Err(if eof || message.contains("Premature end") {
                PreprocessError::Truncated
            } else {
                PreprocessError::Corrupt { message }
            })
        }
    }
}

/// Width and height from the frame header (markers are parsed; no scan is decoded).
pub(crate) fn dimensions(data: &[u8]) -> Result<(u32, u32)> {
    guarded(|| {
        let d = Decompress::with_err(error_mgr()).from_mem(data)?;
        Ok((d.width() as u32, d.height() as u32))
    })
}

/// Decodes to RGB as Pillow does: YCbCr and grey through libjpeg's own conversion;
/// CMYK / YCCK read as CMYK, inverted (Pillow assumes Adobe's convention, `CMYK;I`)
/// and converted with Pillow's `cmyk2rgb`.
pub(crate) fn decode_rgb(data: &[u8]) -> Result<RgbImage> {
    guarded(|| {
        let d = Decompress::with_err(error_mgr()).from_mem(data)?;
        let (width, height) = (d.width() as u32, d.height() as u32);
        let source = d.color_space();
        let cmyk = matches!(source, ColorSpace::JCS_CMYK | ColorSpace::JCS_YCCK);
        let target = if cmyk {
            ColorSpace::JCS_CMYK
        } else {
            ColorSpace::JCS_RGB
        };
        let mut started = d.to_colorspace(target)?;
        let n = started.min_flat_buffer_size();
        let mut raw = reserve::<u8>(n).map_err(|_| std::io::ErrorKind::OutOfMemory)?;
        let read = started.read_scanlines_into_uninit(&mut raw.spare_capacity_mut()[..n])?;
        let read = read.len();
        // SAFETY: the decoder wrote the first `read` bytes (it returns the slice written).
        unsafe { raw.set_len(read) };
        started.finish()?;
        let data = if cmyk { cmyk_to_rgb(&raw) } else { raw };
        Ok(RgbImage {
            width,
            height,
            data,
        })
    })
}

/// Pillow's `CMYK;I` unpacking (inversion) followed by its `cmyk2rgb`.
fn cmyk_to_rgb(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() / 4 * 3);
    for p in raw.chunks_exact(4) {
        let nk = 255 - u32::from(255 - p[3]);
        for &c in &p[..3] {
            let c = u32::from(255 - c);
            let t = c * nk + 128;
            let v = nk - (((t >> 8) + t) >> 8);
            out.push(v as u8);
        }
    }
    out
}
