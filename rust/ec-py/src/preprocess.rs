//! Bindings of `ec_core::preprocess`: the header probe and the Qwen2-VL image rule.
//! Pixels come back in a buffer object (`PixelBuffer`, float32) that
//! `numpy.frombuffer` / `torch.frombuffer` wrap without a copy. The GIL is released for
//! every decode; the images of one call are processed in parallel, and so are the
//! frames of one video (`QwenVlPreprocessor.preprocess_video`).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};

use ec_core::preprocess::{
    self, ClipConfig, ClipOutput, Filter, ImageFormat, PreprocessError, QwenVlConfig, QwenVlOutput,
};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    ec_frontend._core,
    ImageError,
    PyValueError,
    "An image that cannot be preprocessed; `.index` (its position in the call), \
     `.message` and `.code` (`invalid_image` or `image_too_large`) say which and why."
);

fn image_error(py: Python<'_>, index: usize, err: &PreprocessError) -> PyErr {
    let message = err.to_string();
    if let PreprocessError::OutOfMemory { .. } = err {
        return PyMemoryError::new_err(format!("image {index} {message}"));
    }
    let py_err = ImageError::new_err(format!("image {index} {message}"));
    let value = py_err.value(py);
    let set = || -> PyResult<()> {
        value.setattr("index", index)?;
        value.setattr("message", message)?;
        value.setattr("code", err.code())?;
        Ok(())
    };
    match set() {
        Ok(()) => py_err,
        Err(e) => e,
    }
}

fn formats(names: Option<Vec<String>>) -> PyResult<Vec<ImageFormat>> {
    match names {
        None => Ok(ImageFormat::ALL.to_vec()),
        Some(names) => names
            .iter()
            .map(|n| {
                ImageFormat::from_name(n).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "unknown image format {n:?}; known: PNG, JPEG, WEBP, GIF, BMP"
                    ))
                })
            })
            .collect(),
    }
}

/// `(format, width, height)` from the header of `data`; raises `ImageError`.
#[pyfunction]
#[pyo3(signature = (data, *, index = 0, formats = None))]
pub fn probe_image(
    py: Python<'_>,
    data: &[u8],
    index: usize,
    formats: Option<Vec<String>>,
) -> PyResult<(&'static str, u32, u32)> {
    let allowed = self::formats(formats)?;
    let info = preprocess::probe(data, &allowed).map_err(|e| image_error(py, index, &e))?;
    Ok((info.format.name(), info.width, info.height))
}

/// `(width, height, pixels)` of `data` decoded to 8-bit RGB as Pillow's decoder and
/// transformers' `convert_rgb` give it (rows top to bottom, 3 bytes a pixel), the GIL
/// released; raises `ImageError` (with `index`). The first stage of `preprocess`, on
/// its own for tests and benchmarks.
#[pyfunction]
#[pyo3(signature = (data, *, index = 0, formats = None, max_image_pixels = 64_000_000))]
pub fn decode_rgb<'py>(
    py: Python<'py>,
    data: &[u8],
    index: usize,
    formats: Option<Vec<String>>,
    max_image_pixels: u64,
) -> PyResult<(u32, u32, Bound<'py, PyBytes>)> {
    let allowed = self::formats(formats)?;
    let image = py
        .detach(|| preprocess::decode_rgb(data, &allowed, max_image_pixels))
        .map_err(|e| image_error(py, index, &e))?;
    Ok((image.width, image.height, PyBytes::new(py, &image.data)))
}

/// Pixels handed to Python. Rust never reads or writes them after construction (only
/// frees them); Python may write through the buffer (torch wants writable memory), so
/// they live in `UnsafeCell`s.
struct SharedPixels(Box<[UnsafeCell<f32>]>);

// SAFETY: Rust code never accesses the cells after construction; concurrent access
// through exported buffers is Python's (and its users') concern, as for `bytearray`.
unsafe impl Sync for SharedPixels {}

/// Float32 pixels of one image, exposed through the buffer protocol (writable, 1-D).
#[pyclass(module = "ec_frontend._core", name = "PixelBuffer", frozen)]
pub struct PixelBuffer {
    data: SharedPixels,
    shape: [isize; 1],
    strides: [isize; 1],
}

#[pymethods]
impl PixelBuffer {
    fn __len__(&self) -> usize {
        self.data.0.len()
    }

    /// # Safety
    /// Called by Python with a valid `view`; the exported memory lives as long as the
    /// object, which the view holds a reference to.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        let this = slf.get();
        let v = &mut *view;
        v.buf = UnsafeCell::raw_get(this.data.0.as_ptr()) as *mut c_void;
        v.len = (this.data.0.len() * std::mem::size_of::<f32>()) as isize;
        v.readonly = 0;
        v.itemsize = std::mem::size_of::<f32>() as isize;
        v.format = if flags & pyo3::ffi::PyBUF_FORMAT == pyo3::ffi::PyBUF_FORMAT {
            c"f".as_ptr() as *mut _
        } else {
            std::ptr::null_mut()
        };
        v.ndim = 1;
        v.shape = if flags & pyo3::ffi::PyBUF_ND == pyo3::ffi::PyBUF_ND {
            this.shape.as_ptr() as *mut _
        } else {
            std::ptr::null_mut()
        };
        v.strides = if flags & pyo3::ffi::PyBUF_STRIDES == pyo3::ffi::PyBUF_STRIDES {
            this.strides.as_ptr() as *mut _
        } else {
            std::ptr::null_mut()
        };
        v.suboffsets = std::ptr::null_mut();
        v.internal = std::ptr::null_mut();
        v.obj = slf.into_any().into_ptr();
        Ok(())
    }
}

impl PixelBuffer {
    fn new(data: Vec<f32>) -> Self {
        let n = data.len() as isize;
        let boxed: Box<[f32]> = data.into_boxed_slice();
        // SAFETY: `UnsafeCell<f32>` is `repr(transparent)` over `f32`.
        let cells = unsafe { Box::from_raw(Box::into_raw(boxed) as *mut [UnsafeCell<f32>]) };
        Self {
            data: SharedPixels(cells),
            shape: [n],
            strides: [std::mem::size_of::<f32>() as isize],
        }
    }
}

/// One image's pixels, their `(rows, patch_dim)` shape and its `(t, h, w)` grid.
type Preprocessed = (PixelBuffer, (usize, usize), (u32, u32, u32));

/// The Qwen2-VL image rule with a checkpoint's values; see the stub.
#[pyclass(module = "ec_frontend._core", name = "QwenVlPreprocessor", frozen)]
pub struct PyQwenVlPreprocessor {
    config: QwenVlConfig,
    formats: Vec<ImageFormat>,
    max_image_pixels: u64,
}

impl PyQwenVlPreprocessor {
    fn with_pixels(
        &self,
        min_pixels: Option<u64>,
        max_pixels: Option<u64>,
    ) -> PyResult<QwenVlConfig> {
        let mut config = self.config.clone();
        if let Some(v) = min_pixels {
            config.min_pixels = v;
        }
        if let Some(v) = max_pixels {
            config.max_pixels = v;
        }
        config.validate().map_err(PyValueError::new_err)?;
        Ok(config)
    }
}

#[pymethods]
impl PyQwenVlPreprocessor {
    #[new]
    #[pyo3(signature = (*, min_pixels, max_pixels, patch_size, merge_size, temporal_patch_size,
                        rescale_factor, image_mean, image_std, resample = 3, formats = None,
                        max_image_pixels = 64_000_000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        min_pixels: u64,
        max_pixels: u64,
        patch_size: u32,
        merge_size: u32,
        temporal_patch_size: u32,
        rescale_factor: f64,
        image_mean: [f32; 3],
        image_std: [f32; 3],
        resample: i64,
        formats: Option<Vec<String>>,
        max_image_pixels: u64,
    ) -> PyResult<Self> {
        let filter = filter(resample)?;
        let config = QwenVlConfig {
            min_pixels,
            max_pixels,
            patch_size,
            merge_size,
            temporal_patch_size,
            rescale_factor,
            image_mean,
            image_std,
            filter,
        };
        config.validate().map_err(PyValueError::new_err)?;
        Ok(Self {
            config,
            formats: self::formats(formats)?,
            max_image_pixels,
        })
    }

    /// `(t, h, w)` of a `width` x `height` image; raises `ImageError` (index 0).
    #[pyo3(signature = (width, height, *, min_pixels = None, max_pixels = None))]
    fn grid(
        &self,
        py: Python<'_>,
        width: u32,
        height: u32,
        min_pixels: Option<u64>,
        max_pixels: Option<u64>,
    ) -> PyResult<(u32, u32, u32)> {
        let config = self.with_pixels(min_pixels, max_pixels)?;
        config
            .grid(width, height)
            .map_err(|e| image_error(py, 0, &e))
    }

    /// Decodes and preprocesses `images` (bytes each) with the GIL released, in
    /// parallel; returns `[(PixelBuffer, (rows, patch_dim), (t, h, w))]` in order, or
    /// raises `ImageError` for the first image (by position) that fails.
    #[pyo3(signature = (images, *, min_pixels = None, max_pixels = None))]
    fn preprocess(
        &self,
        py: Python<'_>,
        images: Vec<Bound<'_, PyBytes>>,
        min_pixels: Option<u64>,
        max_pixels: Option<u64>,
    ) -> PyResult<Vec<Preprocessed>> {
        let config = self.with_pixels(min_pixels, max_pixels)?;
        let slices: Vec<&[u8]> = images.iter().map(|b| b.as_bytes()).collect();
        let results =
            py.detach(|| config.preprocess_many(&slices, &self.formats, self.max_image_pixels));
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let QwenVlOutput {
                    pixel_values,
                    grid_thw,
                    patch_dim,
                } = r.map_err(|e| image_error(py, i, &e))?;
                let rows = pixel_values.len() / patch_dim.max(1);
                Ok((PixelBuffer::new(pixel_values), (rows, patch_dim), grid_thw))
            })
            .collect()
    }

    /// The video rule over `frames`, a C-contiguous uint8 buffer `[n, height, width, 3]`
    /// (RGB frames), with the GIL released and the frames resized in parallel; returns
    /// `(PixelBuffer, (rows, patch_dim), (t, h, w))` or raises `ImageError` (`index`
    /// names the video). The caller must not write to `frames` during the call.
    #[pyo3(signature = (frames, *, index = 0, min_pixels = None, max_pixels = None))]
    fn preprocess_video(
        &self,
        py: Python<'_>,
        frames: PyBuffer<u8>,
        index: usize,
        min_pixels: Option<u64>,
        max_pixels: Option<u64>,
    ) -> PyResult<Preprocessed> {
        let config = self.with_pixels(min_pixels, max_pixels)?;
        let shape = frames.shape();
        if shape.len() != 4 || shape[3] != 3 || !frames.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "frames must be a C-contiguous uint8 [n, height, width, 3] array, got shape \
                 {shape:?}"
            )));
        }
        let (count, height, width) = (shape[0], shape[1], shape[2]);
        let (Ok(height), Ok(width)) = (u32::try_from(height), u32::try_from(width)) else {
            return Err(PyValueError::new_err("frame size out of range"));
        };
        // SAFETY: the buffer is exported (held by `frames`) for the whole call, C-contiguous
        // and `item_count` bytes long; the caller does not write to it meanwhile (the
        // contract above), so reading it as a shared slice is sound.
        let data: &[u8] = unsafe {
            std::slice::from_raw_parts(frames.buf_ptr() as *const u8, frames.item_count())
        };
        let out = py
            .detach(|| config.preprocess_video(data, count, width, height))
            .map_err(|e| image_error(py, index, &e))?;
        let QwenVlOutput {
            pixel_values,
            grid_thw,
            patch_dim,
        } = out;
        let rows = pixel_values.len() / patch_dim.max(1);
        Ok((PixelBuffer::new(pixel_values), (rows, patch_dim), grid_thw))
    }
}

fn filter(resample: i64) -> PyResult<Filter> {
    Filter::from_pillow(resample).ok_or_else(|| {
        PyValueError::new_err(format!(
            "resample {resample} is not supported natively (2 bilinear, 3 bicubic)"
        ))
    })
}

/// One image's pixels, their `(1, 3, height, width)` shape.
type ClipPreprocessed = (PixelBuffer, (usize, usize, usize, usize));

/// The CLIP image rule (shortest edge, centre crop) with a checkpoint's values.
#[pyclass(module = "ec_frontend._core", name = "ClipPreprocessor", frozen)]
pub struct PyClipPreprocessor {
    config: ClipConfig,
    formats: Vec<ImageFormat>,
    max_image_pixels: u64,
}

#[pymethods]
impl PyClipPreprocessor {
    #[new]
    #[pyo3(signature = (*, shortest_edge, crop_height, crop_width, rescale_factor, image_mean,
                        image_std, resample = 3, formats = None, max_image_pixels = 64_000_000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        shortest_edge: u32,
        crop_height: u32,
        crop_width: u32,
        rescale_factor: f64,
        image_mean: [f32; 3],
        image_std: [f32; 3],
        resample: i64,
        formats: Option<Vec<String>>,
        max_image_pixels: u64,
    ) -> PyResult<Self> {
        let config = ClipConfig {
            shortest_edge,
            crop_height,
            crop_width,
            rescale_factor,
            image_mean,
            image_std,
            filter: filter(resample)?,
        };
        config.validate().map_err(PyValueError::new_err)?;
        Ok(Self {
            config,
            formats: self::formats(formats)?,
            max_image_pixels,
        })
    }

    /// Decodes and preprocesses `images` with the GIL released, in parallel; returns
    /// `[(PixelBuffer, (1, 3, height, width))]` in order, or raises `ImageError` for the
    /// first image (by position) that fails.
    fn preprocess(
        &self,
        py: Python<'_>,
        images: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<Vec<ClipPreprocessed>> {
        let slices: Vec<&[u8]> = images.iter().map(|b| b.as_bytes()).collect();
        let results = py.detach(|| {
            self.config
                .preprocess_many(&slices, &self.formats, self.max_image_pixels)
        });
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let ClipOutput {
                    pixel_values,
                    height,
                    width,
                } = r.map_err(|e| image_error(py, i, &e))?;
                let shape = (1, 3, height as usize, width as usize);
                Ok((PixelBuffer::new(pixel_values), shape))
            })
            .collect()
    }
}

/// Registers the functions and classes of this file on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let error_type = py.get_type::<ImageError>();
    error_type.setattr("index", 0)?;
    error_type.setattr("message", "")?;
    error_type.setattr("code", "")?;
    m.add("ImageError", error_type)?;
    m.add_class::<PixelBuffer>()?;
    m.add_class::<PyQwenVlPreprocessor>()?;
    m.add_class::<PyClipPreprocessor>()?;
    m.add_function(wrap_pyfunction!(probe_image, m)?)?;
    m.add_function(wrap_pyfunction!(decode_rgb, m)?)?;
    Ok(())
}
