//! The normalized request that every endpoint parses into.

use serde::Serialize;

use crate::error::RequestError;
use crate::value::OwnedValue;

/// The four request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    Chat,
    Completions,
    Responses,
    Generate,
}

impl Endpoint {
    /// `chat`, `completions`, `responses` or `generate`.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Generate => "generate",
        }
    }

    /// The endpoint of a short name or a route path (`/v1/chat/completions`).
    pub fn from_name(name: &str) -> Result<Self, RequestError> {
        match name.trim_end_matches('/') {
            "chat" | "chat/completions" | "/v1/chat/completions" => Ok(Endpoint::Chat),
            "completions" | "/v1/completions" => Ok(Endpoint::Completions),
            "responses" | "/v1/responses" => Ok(Endpoint::Responses),
            "generate" | "/inference/v1/generate" => Ok(Endpoint::Generate),
            _ => Err(RequestError::UnknownEndpoint {
                endpoint: name.chars().take(100).collect(),
            }),
        }
    }
}

/// Normalized sampling parameters (vLLM `SamplingParams` names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplingParams {
    /// `None`: up to the context length (the server decides).
    pub max_tokens: Option<u64>,
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k (`-1` in a request means the same and is normalized to 0).
    pub top_k: i64,
    pub min_p: f64,
    pub seed: Option<i64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub n: u32,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    /// Number of top logprobs per generated token; `None`: no logprobs.
    pub logprobs: Option<u32>,
    /// Number of top logprobs per prompt token; `-1`: the whole vocabulary.
    pub prompt_logprobs: Option<i32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub include_stop_str_in_output: bool,
    /// `logit_bias`: (token id, bias clamped to [-100, 100]) in request order; a
    /// repeated id keeps its last bias.
    pub logit_bias: Option<Vec<(u32, f64)>>,
    /// `allowed_token_ids`: sampling is restricted to these (never empty).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// No end of sequence, stop token or stop string before this many tokens.
    pub min_tokens: u64,
    /// vLLM's `bad_words`: words whose last token is banned where the tokens before it
    /// were just generated (deduplicated, never empty strings).
    pub bad_words: Vec<String>,
    /// The merged `vllm_xargs` (with `kv_transfer_params` / `ec_transfer_params`).
    pub extra_args: Option<OwnedValue>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            n: 1,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logprobs: None,
            prompt_logprobs: None,
            ignore_eos: false,
            skip_special_tokens: true,
            include_stop_str_in_output: false,
            logit_bias: None,
            allowed_token_ids: None,
            min_tokens: 0,
            bad_words: Vec::new(),
            extra_args: None,
        }
    }
}

/// A chat role after normalization (`developer` becomes `system`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's result (`tool_call_id` names the call it answers).
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text {
        text: String,
    },
    /// An index into [`ParsedRequest::media`].
    Image {
        media_index: usize,
    },
    /// An index into [`ParsedRequest::media`] (a `video_url` part).
    Video {
        media_index: usize,
    },
}

/// A chat message with its content as parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub role: Role,
    pub content: Vec<Part>,
    /// An assistant message's `tool_calls` (checked: `id`, `type`, `function.name`,
    /// `function.arguments`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<OwnedValue>,
    /// A tool message's `tool_call_id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message with no tool fields.
    pub fn new(role: Role, content: Vec<Part>) -> Self {
        Self {
            role,
            content,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A completions prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One media item, in order of appearance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MediaItem {
    /// `image` or `video`.
    pub kind: &'static str,
    /// The media type of an inline item (`image/png`); `None` for a URL reference.
    pub mime_type: Option<String>,
    /// The decoded bytes of an inline item; `None` for a URL reference.
    #[serde(skip)]
    pub data: Option<Vec<u8>>,
    /// The http(s) or `file://` URL of a referenced item.
    pub url: Option<String>,
    pub uuid: Option<String>,
    /// Lower-case hex (see [`crate::media`]).
    pub mm_hash: String,
    /// Where the item sits in the body (`messages[0].content[1].image_url`).
    pub param: String,
    /// For an `image_embeds` reference (no bytes, no URL): the `[t, h, w]` patch grid
    /// its encoder reported, which sizes its placeholder; its encoder output must come
    /// through the EC connector.
    pub grid_thw: Option<[u32; 3]>,
    /// For a `video_embeds` reference that carries it: the seconds one temporal patch
    /// of the video spans (vLLM's `second_per_grid_ts`, Qwen2.5-VL's absolute time), a
    /// finite number in `(0, MAX_SECOND_PER_GRID_T]`. Whether a model needs it, or
    /// refuses it, is the model's to say.
    pub second_per_grid_ts: Option<f64>,
    /// For a `video_embeds` reference that carries them: the time of each temporal
    /// patch in seconds (vLLM's `timestamps`, which Qwen3-VL writes into the prompt),
    /// one per patch of the grid's `t`. Whether a model needs them is the model's to say.
    pub timestamps: Option<Vec<f64>>,
}

impl MediaItem {
    /// Decoded size in bytes (0 for a URL reference).
    pub fn len(&self) -> usize {
        self.data.as_ref().map_or(0, Vec::len)
    }

    /// True for a URL reference.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A placeholder range of one media item in a generate request's `token_ids`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Placeholder {
    pub offset: usize,
    pub length: usize,
}

/// Multimodal features of a generate request, one entry per item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Features {
    pub mm_hashes: Vec<String>,
    pub mm_placeholders: Vec<Placeholder>,
    pub mm_grid_thw: Option<Vec<[u32; 3]>>,
}

/// A validated request, normalized across the four endpoints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` with `include_usage`: usage on every chunk.
    pub continuous_usage_stats: bool,
    /// vLLM's `stream_interval` (chat, completions): a stream chunk per this many tokens
    /// (the first and last chunks are sent at once).
    pub stream_interval: u64,
    /// vLLM's `return_token_ids` (chat, completions, generate).
    pub return_token_ids: bool,
    /// Generate's `output_mode`: `tokens` (the default) or `text`.
    pub output_mode: &'static str,
    /// vLLM's `continue_final_message` (chat): the template leaves the last message
    /// open; never with `add_generation_prompt`.
    pub continue_final_message: bool,
    /// vLLM's `truncate_prompt_tokens` (chat, completions): keep this many prompt
    /// tokens (`-1`: as many as the context allows).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's `truncation_side`: `left` keeps the last tokens, `right` the first;
    /// `None`: the tokenizer's side.
    pub truncation_side: Option<&'static str>,
    pub user: Option<String>,
    /// `request_id` of a generate request.
    pub request_id: Option<String>,
    pub sampling: SamplingParams,
    /// Chat and responses requests.
    pub messages: Option<Vec<Message>>,
    /// Completions requests.
    pub prompts: Option<Vec<Prompt>>,
    /// Generate requests.
    pub token_ids: Option<Vec<u32>>,
    /// Generate requests.
    pub features: Option<Features>,
    pub media: Vec<MediaItem>,
    /// Whether the body had a top-level `kv_transfer_params` object; the value itself
    /// lives in `sampling.extra_args` (see [`ParsedRequest::kv_transfer_params`]).
    #[serde(skip)]
    pub has_kv_transfer_params: bool,
    /// As `has_kv_transfer_params`, for `ec_transfer_params`.
    #[serde(skip)]
    pub has_ec_transfer_params: bool,
    pub mm_processor_kwargs: Option<OwnedValue>,
    /// vLLM's `media_io_kwargs` (chat, responses): `{"video": {"num_frames", "fps"}}`,
    /// checked; its `video` object enters every video key.
    pub media_io_kwargs: Option<OwnedValue>,
    pub chat_template_kwargs: Option<OwnedValue>,
    pub add_generation_prompt: bool,
    pub echo: bool,
    /// Responses requests (also prepended as a system message).
    pub instructions: Option<String>,
    /// vLLM's tenant salt (chat, completions, responses): it enters every media key of
    /// the request, so requests with different salts never share an encoder-cache entry.
    pub cache_salt: Option<String>,
    /// Structured outputs and tools, normalized (see [`crate::structured`]); `None`
    /// when the request constrains nothing and offers no tools.
    pub structured: Option<OwnedValue>,
    /// Top-level fields accepted and ignored (`sampling_params.x` for generate).
    pub unknown_fields: Vec<String>,
}

impl ParsedRequest {
    pub(crate) fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            model: None,
            stream: false,
            include_usage: false,
            continuous_usage_stats: false,
            stream_interval: 1,
            return_token_ids: false,
            output_mode: "tokens",
            continue_final_message: false,
            truncate_prompt_tokens: None,
            truncation_side: None,
            user: None,
            request_id: None,
            sampling: SamplingParams::default(),
            messages: None,
            prompts: None,
            token_ids: None,
            features: None,
            media: Vec::new(),
            has_kv_transfer_params: false,
            has_ec_transfer_params: false,
            mm_processor_kwargs: None,
            media_io_kwargs: None,
            chat_template_kwargs: None,
            add_generation_prompt: true,
            echo: false,
            instructions: None,
            cache_salt: None,
            structured: None,
            unknown_fields: Vec::new(),
        }
    }
}

impl ParsedRequest {
    fn extra_arg(&self, present: bool, key: &str) -> Option<&OwnedValue> {
        if !present {
            return None;
        }
        self.sampling.extra_args.as_ref()?.get(key)
    }

    /// The top-level `kv_transfer_params` (`None` when absent or `null`). Stored once,
    /// in `sampling.extra_args`, where the top-level field always wins.
    pub fn kv_transfer_params(&self) -> Option<&OwnedValue> {
        self.extra_arg(self.has_kv_transfer_params, crate::merge::KV_KEY)
    }

    /// The top-level `ec_transfer_params` (`None` when absent or `null`).
    pub fn ec_transfer_params(&self) -> Option<&OwnedValue> {
        self.extra_arg(self.has_ec_transfer_params, crate::merge::EC_KEY)
    }

    /// The request as JSON (media bytes left out), for logs and tests.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct View<'r> {
            #[serde(flatten)]
            request: &'r ParsedRequest,
            kv_transfer_params: Option<&'r OwnedValue>,
            ec_transfer_params: Option<&'r OwnedValue>,
        }
        let view = View {
            request: self,
            kv_transfer_params: self.kv_transfer_params(),
            ec_transfer_params: self.ec_transfer_params(),
        };
        serde_json::to_string(&view).unwrap_or_default()
    }
}
