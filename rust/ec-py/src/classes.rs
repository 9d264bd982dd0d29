//! The Python classes: `Limits`, `MediaItem`, `ParsedRequest`.

use std::sync::{Mutex, OnceLock};

use ec_core::{Endpoint, Features, Message, Part, Prompt, Role, SamplingParams};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::convert::{opt_value_to_py, value_to_py};

/// Bounds applied while parsing. All sizes are in bytes.
#[pyclass(module = "ec_frontend._core", name = "Limits")]
#[derive(Clone)]
pub struct PyLimits {
    pub inner: ec_core::Limits,
}

#[pymethods]
impl PyLimits {
    #[new]
    #[pyo3(signature = (
        *,
        max_body_bytes = 64 * 1024 * 1024,
        max_depth = 64,
        max_messages = 1024,
        max_media_items = 64,
        max_string_bytes = 16 * 1024 * 1024,
        max_media_bytes = 32 * 1024 * 1024,
        max_token_ids = 1_048_576,
    ))]
    fn new(
        max_body_bytes: usize,
        max_depth: usize,
        max_messages: usize,
        max_media_items: usize,
        max_string_bytes: usize,
        max_media_bytes: usize,
        max_token_ids: usize,
    ) -> Self {
        Self {
            inner: ec_core::Limits {
                max_body_bytes,
                max_depth,
                max_messages,
                max_media_items,
                max_string_bytes,
                max_media_bytes,
                max_token_ids,
            },
        }
    }

    #[getter]
    fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }
    #[setter]
    fn set_max_body_bytes(&mut self, v: usize) {
        self.inner.max_body_bytes = v;
    }
    #[getter]
    fn max_depth(&self) -> usize {
        self.inner.max_depth
    }
    #[setter]
    fn set_max_depth(&mut self, v: usize) {
        self.inner.max_depth = v;
    }
    #[getter]
    fn max_messages(&self) -> usize {
        self.inner.max_messages
    }
    #[setter]
    fn set_max_messages(&mut self, v: usize) {
        self.inner.max_messages = v;
    }
    #[getter]
    fn max_media_items(&self) -> usize {
        self.inner.max_media_items
    }
    #[setter]
    fn set_max_media_items(&mut self, v: usize) {
        self.inner.max_media_items = v;
    }
    #[getter]
    fn max_string_bytes(&self) -> usize {
        self.inner.max_string_bytes
    }
    #[setter]
    fn set_max_string_bytes(&mut self, v: usize) {
        self.inner.max_string_bytes = v;
    }
    #[getter]
    fn max_media_bytes(&self) -> usize {
        self.inner.max_media_bytes
    }
    #[setter]
    fn set_max_media_bytes(&mut self, v: usize) {
        self.inner.max_media_bytes = v;
    }
    #[getter]
    fn max_token_ids(&self) -> usize {
        self.inner.max_token_ids
    }
    #[setter]
    fn set_max_token_ids(&mut self, v: usize) {
        self.inner.max_token_ids = v;
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Limits(max_body_bytes={}, max_depth={}, max_messages={}, max_media_items={}, \
             max_string_bytes={}, max_media_bytes={}, max_token_ids={})",
            l.max_body_bytes,
            l.max_depth,
            l.max_messages,
            l.max_media_items,
            l.max_string_bytes,
            l.max_media_bytes,
            l.max_token_ids
        )
    }
}

/// One media item of a request, in order of appearance.
#[pyclass(module = "ec_frontend._core", name = "MediaItem", frozen)]
pub struct PyMediaItem {
    kind: &'static str,
    mime_type: Option<String>,
    /// The decoded bytes until `.data` is first read; then moved into `data`.
    raw: Mutex<Option<Vec<u8>>>,
    /// The `bytes` object, made once on first read; every `.data` returns it. An item
    /// whose bytes are never read (its encoder output is cached) is never copied.
    data: OnceLock<Py<PyBytes>>,
    len: usize,
    url: Option<String>,
    uuid: Option<String>,
    mm_hash: String,
    param: String,
    grid_thw: Option<[u32; 3]>,
    second_per_grid_ts: Option<f64>,
    timestamps: Option<Vec<f64>>,
}

impl PyMediaItem {
    /// Moves an item into Python; its bytes become a `bytes` object on first read.
    pub fn from_core(item: ec_core::MediaItem) -> Self {
        let len = item.len();
        Self {
            raw: Mutex::new(item.data),
            data: OnceLock::new(),
            len,
            kind: item.kind,
            mime_type: item.mime_type,
            url: item.url,
            uuid: item.uuid,
            mm_hash: item.mm_hash,
            param: item.param,
            grid_thw: item.grid_thw,
            second_per_grid_ts: item.second_per_grid_ts,
            timestamps: item.timestamps,
        }
    }
}

impl PyMediaItem {
    fn reference_grid(&self, kind: &str) -> Option<(u32, u32, u32)> {
        self.grid_thw
            .filter(|_| self.kind == kind)
            .map(|[t, h, w]| (t, h, w))
    }
}

#[pymethods]
impl PyMediaItem {
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }
    #[getter]
    fn mime_type(&self) -> Option<&str> {
        self.mime_type.as_deref()
    }
    #[getter]
    fn data(&self, py: Python<'_>) -> Option<Py<PyBytes>> {
        if let Some(bytes) = self.data.get() {
            return Some(bytes.clone_ref(py));
        }
        // Under the lock, so that a concurrent first read (free-threaded Python) waits
        // for the one `bytes` object instead of finding the raw bytes gone.
        let mut raw = self
            .raw
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(bytes) = self.data.get() {
            return Some(bytes.clone_ref(py));
        }
        let decoded = raw.take()?;
        let bytes = self
            .data
            .get_or_init(|| PyBytes::new(py, &decoded).unbind());
        Some(bytes.clone_ref(py))
    }
    #[getter]
    fn url(&self) -> Option<&str> {
        self.url.as_deref()
    }
    #[getter]
    fn uuid(&self) -> Option<&str> {
        self.uuid.as_deref()
    }
    #[getter]
    fn mm_hash(&self) -> &str {
        &self.mm_hash
    }
    #[getter]
    fn param(&self) -> &str {
        &self.param
    }
    /// `(t, h, w)` of an `image_embeds` reference; `None` for any other item.
    #[getter]
    fn image_grid_thw(&self) -> Option<(u32, u32, u32)> {
        self.reference_grid("image")
    }
    /// `(t, h, w)` of a `video_embeds` reference; `None` for any other item.
    #[getter]
    fn video_grid_thw(&self) -> Option<(u32, u32, u32)> {
        self.reference_grid("video")
    }
    /// The seconds per temporal patch a `video_embeds` reference carries
    /// (`second_per_grid_ts`); `None` when it has none, and for any other item.
    #[getter]
    fn second_per_grid_ts(&self) -> Option<f64> {
        self.second_per_grid_ts
    }
    /// The time of each temporal patch a `video_embeds` reference carries
    /// (`timestamps`, one per patch); `None` when it has none, and for any other item.
    #[getter]
    fn timestamps(&self) -> Option<Vec<f64>> {
        self.timestamps.clone()
    }
    fn __len__(&self) -> usize {
        self.len
    }
    fn __repr__(&self) -> String {
        if let Some([t, h, w]) = self.grid_thw {
            return format!(
                "MediaItem(kind='{kind}', {kind}_grid_thw=({t}, {h}, {w}), mm_hash='{}')",
                self.mm_hash,
                kind = self.kind
            );
        }
        match &self.url {
            Some(url) => format!(
                "MediaItem(kind='{}', url={url:?}, mm_hash='{}')",
                self.kind, self.mm_hash
            ),
            None => format!(
                "MediaItem(kind='{}', mime_type={:?}, len={}, mm_hash='{}')",
                self.kind,
                self.mime_type.as_deref().unwrap_or(""),
                self.len,
                self.mm_hash
            ),
        }
    }
}

/// A validated request, normalized across the four endpoints.
#[pyclass(module = "ec_frontend._core", name = "ParsedRequest", frozen)]
pub struct PyParsedRequest {
    /// The core result; its media moved into `media`.
    pub inner: ec_core::ParsedRequest,
    pub media: Vec<Py<PyMediaItem>>,
}

fn sampling_to_py<'py>(py: Python<'py>, s: &SamplingParams) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(intern!(py, "max_tokens"), s.max_tokens)?;
    d.set_item(intern!(py, "temperature"), s.temperature)?;
    d.set_item(intern!(py, "top_p"), s.top_p)?;
    d.set_item(intern!(py, "top_k"), s.top_k)?;
    d.set_item(intern!(py, "min_p"), s.min_p)?;
    d.set_item(intern!(py, "seed"), s.seed)?;
    d.set_item(intern!(py, "stop"), PyList::new(py, &s.stop)?)?;
    d.set_item(
        intern!(py, "stop_token_ids"),
        PyList::new(py, &s.stop_token_ids)?,
    )?;
    d.set_item(intern!(py, "n"), s.n)?;
    d.set_item(intern!(py, "presence_penalty"), s.presence_penalty)?;
    d.set_item(intern!(py, "frequency_penalty"), s.frequency_penalty)?;
    d.set_item(intern!(py, "repetition_penalty"), s.repetition_penalty)?;
    d.set_item(intern!(py, "logprobs"), s.logprobs)?;
    d.set_item(intern!(py, "prompt_logprobs"), s.prompt_logprobs)?;
    d.set_item(intern!(py, "ignore_eos"), s.ignore_eos)?;
    d.set_item(intern!(py, "skip_special_tokens"), s.skip_special_tokens)?;
    d.set_item(
        intern!(py, "include_stop_str_in_output"),
        s.include_stop_str_in_output,
    )?;
    let logit_bias = match &s.logit_bias {
        Some(pairs) => {
            let bias = PyDict::new(py);
            for (id, b) in pairs {
                bias.set_item(id, b)?;
            }
            Some(bias)
        }
        None => None,
    };
    d.set_item(intern!(py, "logit_bias"), logit_bias)?;
    d.set_item(
        intern!(py, "allowed_token_ids"),
        s.allowed_token_ids.as_ref(),
    )?;
    d.set_item(intern!(py, "min_tokens"), s.min_tokens)?;
    d.set_item(intern!(py, "bad_words"), &s.bad_words)?;
    d.set_item(
        intern!(py, "extra_args"),
        opt_value_to_py(py, s.extra_args.as_ref())?,
    )?;
    Ok(d)
}

fn role_to_py(py: Python<'_>, role: Role) -> &Bound<'_, PyString> {
    match role {
        Role::System => intern!(py, "system"),
        Role::User => intern!(py, "user"),
        Role::Assistant => intern!(py, "assistant"),
        Role::Tool => intern!(py, "tool"),
    }
}

fn messages_to_py<'py>(py: Python<'py>, messages: &[Message]) -> PyResult<Bound<'py, PyList>> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let mut parts = Vec::with_capacity(m.content.len());
        for part in &m.content {
            let p = PyDict::new(py);
            match part {
                Part::Text { text } => {
                    p.set_item(intern!(py, "type"), intern!(py, "text"))?;
                    p.set_item(intern!(py, "text"), PyString::new(py, text))?;
                }
                Part::Image { media_index } => {
                    p.set_item(intern!(py, "type"), intern!(py, "image"))?;
                    p.set_item(intern!(py, "media_index"), *media_index)?;
                }
                Part::Video { media_index } => {
                    p.set_item(intern!(py, "type"), intern!(py, "video"))?;
                    p.set_item(intern!(py, "media_index"), *media_index)?;
                }
            }
            parts.push(p);
        }
        let msg = PyDict::new(py);
        msg.set_item(intern!(py, "role"), role_to_py(py, m.role))?;
        msg.set_item(intern!(py, "content"), PyList::new(py, parts)?)?;
        if let Some(calls) = &m.tool_calls {
            msg.set_item(intern!(py, "tool_calls"), value_to_py(py, calls)?)?;
        }
        if let Some(id) = &m.tool_call_id {
            msg.set_item(intern!(py, "tool_call_id"), PyString::new(py, id))?;
        }
        out.push(msg);
    }
    PyList::new(py, out)
}

fn features_to_py<'py>(py: Python<'py>, f: &Features) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("mm_hashes", PyList::new(py, &f.mm_hashes)?)?;
    let places = PyList::empty(py);
    for p in &f.mm_placeholders {
        let item = PyDict::new(py);
        item.set_item("offset", p.offset)?;
        item.set_item("length", p.length)?;
        places.append(item)?;
    }
    d.set_item("mm_placeholders", places)?;
    match &f.mm_grid_thw {
        Some(grid) => {
            let rows = PyList::empty(py);
            for row in grid {
                rows.append(PyList::new(py, row)?)?;
            }
            d.set_item("mm_grid_thw", rows)?;
        }
        None => d.set_item("mm_grid_thw", py.None())?,
    }
    Ok(d)
}

#[pymethods]
impl PyParsedRequest {
    #[getter]
    fn endpoint(&self) -> &'static str {
        self.inner.endpoint.as_str()
    }
    #[getter]
    fn model(&self) -> Option<&str> {
        self.inner.model.as_deref()
    }
    #[getter]
    fn stream(&self) -> bool {
        self.inner.stream
    }
    #[getter]
    fn include_usage(&self) -> bool {
        self.inner.include_usage
    }
    #[getter]
    fn continuous_usage_stats(&self) -> bool {
        self.inner.continuous_usage_stats
    }
    #[getter]
    fn stream_interval(&self) -> u64 {
        self.inner.stream_interval
    }
    #[getter]
    fn return_token_ids(&self) -> bool {
        self.inner.return_token_ids
    }
    #[getter]
    fn output_mode(&self) -> &'static str {
        self.inner.output_mode
    }
    #[getter]
    fn continue_final_message(&self) -> bool {
        self.inner.continue_final_message
    }
    #[getter]
    fn truncate_prompt_tokens(&self) -> Option<i64> {
        self.inner.truncate_prompt_tokens
    }
    #[getter]
    fn truncation_side(&self) -> Option<&'static str> {
        self.inner.truncation_side
    }
    #[getter]
    fn n(&self) -> u32 {
        self.inner.sampling.n
    }
    #[getter]
    fn user(&self) -> Option<&str> {
        self.inner.user.as_deref()
    }
    #[getter]
    fn request_id(&self) -> Option<&str> {
        self.inner.request_id.as_deref()
    }
    #[getter]
    fn sampling<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        sampling_to_py(py, &self.inner.sampling)
    }
    #[getter]
    fn messages<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .messages
            .as_deref()
            .map(|m| messages_to_py(py, m))
            .transpose()
    }
    #[getter]
    fn prompts<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(prompts) = &self.inner.prompts else {
            return Ok(None);
        };
        let out = PyList::empty(py);
        for p in prompts {
            match p {
                Prompt::Text(s) => out.append(PyString::new(py, s))?,
                Prompt::Tokens(ids) => out.append(PyList::new(py, ids)?)?,
            }
        }
        Ok(Some(out))
    }
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .token_ids
            .as_ref()
            .map(|ids| PyList::new(py, ids))
            .transpose()
    }
    #[getter]
    fn features<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner
            .features
            .as_ref()
            .map(|f| features_to_py(py, f))
            .transpose()
    }
    #[getter]
    fn media<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.media.iter().map(|m| m.clone_ref(py)))
    }
    #[getter]
    fn kv_transfer_params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.kv_transfer_params())
    }
    #[getter]
    fn ec_transfer_params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.ec_transfer_params())
    }
    #[getter]
    fn mm_processor_kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.mm_processor_kwargs.as_ref())
    }
    #[getter]
    fn media_io_kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.media_io_kwargs.as_ref())
    }
    #[getter]
    fn chat_template_kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.chat_template_kwargs.as_ref())
    }
    /// Structured outputs and tools, normalized (`None` when the request has neither).
    #[getter]
    fn structured<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        opt_value_to_py(py, self.inner.structured.as_ref())
    }
    #[getter]
    fn add_generation_prompt(&self) -> bool {
        self.inner.add_generation_prompt
    }
    #[getter]
    fn echo(&self) -> bool {
        self.inner.echo
    }
    #[getter]
    fn instructions(&self) -> Option<&str> {
        self.inner.instructions.as_deref()
    }
    #[getter]
    fn cache_salt(&self) -> Option<&str> {
        self.inner.cache_salt.as_deref()
    }
    #[getter]
    fn unknown_fields(&self) -> Vec<String> {
        self.inner.unknown_fields.clone()
    }
    /// The whole request as a JSON string (media bytes left out), for logging and tests.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }
    fn __repr__(&self) -> String {
        let r = &self.inner;
        let body = match r.endpoint {
            Endpoint::Chat | Endpoint::Responses => {
                format!("messages={}", r.messages.as_ref().map_or(0, Vec::len))
            }
            Endpoint::Completions => format!("prompts={}", r.prompts.as_ref().map_or(0, Vec::len)),
            Endpoint::Generate => format!("token_ids={}", r.token_ids.as_ref().map_or(0, Vec::len)),
        };
        let model = r
            .model
            .as_deref()
            .map_or("None".to_owned(), |m| format!("{m:?}"));
        let stream = if r.stream { "True" } else { "False" };
        format!(
            "ParsedRequest(endpoint='{}', model={model}, {body}, media={}, stream={stream})",
            r.endpoint.as_str(),
            self.media.len(),
        )
    }
}
