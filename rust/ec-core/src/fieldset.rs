//! Known request fields, gathered from an object in one pass.

use crate::path::Path;
use crate::value::Value;

use crate::fields::Members;

/// Every field name the parser knows, on any endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum F {
    Model,
    Messages,
    Prompt,
    Input,
    Instructions,
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    Temperature,
    TopP,
    TopK,
    MinP,
    Seed,
    Stop,
    StopTokenIds,
    N,
    PresencePenalty,
    FrequencyPenalty,
    RepetitionPenalty,
    Logprobs,
    TopLogprobs,
    PromptLogprobs,
    IgnoreEos,
    SkipSpecialTokens,
    IncludeStopStrInOutput,
    Stream,
    StreamOptions,
    User,
    KvTransferParams,
    EcTransferParams,
    VllmXargs,
    MmProcessorKwargs,
    ChatTemplateKwargs,
    AddGenerationPrompt,
    Echo,
    RequestId,
    TokenIds,
    SamplingParams,
    Features,
    ExtraArgs,
    CacheSalt,
    LogitBias,
    AllowedTokenIds,
    MinTokens,
    ReturnTokenIds,
    OutputMode,
    StreamInterval,
    BadWords,
    ContinueFinalMessage,
    TruncatePromptTokens,
    TruncationSide,
    Include,
    ResponseFormat,
    StructuredOutputs,
    Text,
    Tools,
    ToolChoice,
    ParallelToolCalls,
    MediaIoKwargs,
}

const COUNT: usize = F::MediaIoKwargs as usize + 1;

impl F {
    /// The field of a key, on any endpoint.
    pub fn of(key: &str) -> Option<F> {
        Some(match key {
            "model" => F::Model,
            "messages" => F::Messages,
            "prompt" => F::Prompt,
            "input" => F::Input,
            "instructions" => F::Instructions,
            "max_tokens" => F::MaxTokens,
            "max_completion_tokens" => F::MaxCompletionTokens,
            "max_output_tokens" => F::MaxOutputTokens,
            "temperature" => F::Temperature,
            "top_p" => F::TopP,
            "top_k" => F::TopK,
            "min_p" => F::MinP,
            "seed" => F::Seed,
            "stop" => F::Stop,
            "stop_token_ids" => F::StopTokenIds,
            "n" => F::N,
            "presence_penalty" => F::PresencePenalty,
            "frequency_penalty" => F::FrequencyPenalty,
            "repetition_penalty" => F::RepetitionPenalty,
            "logprobs" => F::Logprobs,
            "top_logprobs" => F::TopLogprobs,
            "prompt_logprobs" => F::PromptLogprobs,
            "ignore_eos" => F::IgnoreEos,
            "skip_special_tokens" => F::SkipSpecialTokens,
            "include_stop_str_in_output" => F::IncludeStopStrInOutput,
            "stream" => F::Stream,
            "stream_options" => F::StreamOptions,
            "user" => F::User,
            "kv_transfer_params" => F::KvTransferParams,
            "ec_transfer_params" => F::EcTransferParams,
            "vllm_xargs" => F::VllmXargs,
            "mm_processor_kwargs" => F::MmProcessorKwargs,
            "chat_template_kwargs" => F::ChatTemplateKwargs,
            "add_generation_prompt" => F::AddGenerationPrompt,
            "echo" => F::Echo,
            "request_id" => F::RequestId,
            "token_ids" => F::TokenIds,
            "sampling_params" => F::SamplingParams,
            "features" => F::Features,
            "extra_args" => F::ExtraArgs,
            "cache_salt" => F::CacheSalt,
            "logit_bias" => F::LogitBias,
            "allowed_token_ids" => F::AllowedTokenIds,
            "min_tokens" => F::MinTokens,
            "return_token_ids" => F::ReturnTokenIds,
            "output_mode" => F::OutputMode,
            "stream_interval" => F::StreamInterval,
            "bad_words" => F::BadWords,
            "continue_final_message" => F::ContinueFinalMessage,
            "truncate_prompt_tokens" => F::TruncatePromptTokens,
            "truncation_side" => F::TruncationSide,
            "include" => F::Include,
            "response_format" => F::ResponseFormat,
            "structured_outputs" => F::StructuredOutputs,
            "text" => F::Text,
            "tools" => F::Tools,
            "tool_choice" => F::ToolChoice,
            "parallel_tool_calls" => F::ParallelToolCalls,
            "media_io_kwargs" => F::MediaIoKwargs,
            _ => return None,
        })
    }

    /// The wire name.
    pub fn name(self) -> &'static str {
        NAMES[self as usize]
    }

    const fn bit(self) -> u64 {
        1 << (self as u8)
    }
}

const NAMES: [&str; COUNT] = [
    "model",
    "messages",
    "prompt",
    "input",
    "instructions",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "user",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "mm_processor_kwargs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "echo",
    "request_id",
    "token_ids",
    "sampling_params",
    "features",
    "extra_args",
    "cache_salt",
    "logit_bias",
    "allowed_token_ids",
    "min_tokens",
    "return_token_ids",
    "output_mode",
    "stream_interval",
    "bad_words",
    "continue_final_message",
    "truncate_prompt_tokens",
    "truncation_side",
    "include",
    "response_format",
    "structured_outputs",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "media_io_kwargs",
];

/// A set of fields.
#[derive(Debug, Clone, Copy)]
pub struct Mask(u64);

impl Mask {
    pub const fn of(fields: &[F]) -> Mask {
        let mut bits = 0;
        let mut i = 0;
        while i < fields.len() {
            bits |= fields[i].bit();
            i += 1;
        }
        Mask(bits)
    }

    pub const fn union(self, other: Mask) -> Mask {
        Mask(self.0 | other.0)
    }

    pub fn contains(self, f: F) -> bool {
        self.0 & f.bit() != 0
    }
}

/// Sampling fields shared by chat, completions and generate's `sampling_params`.
pub const SAMPLING: Mask = Mask::of(&[
    F::MaxTokens,
    F::Temperature,
    F::TopP,
    F::TopK,
    F::MinP,
    F::Seed,
    F::Stop,
    F::StopTokenIds,
    F::N,
    F::PresencePenalty,
    F::FrequencyPenalty,
    F::RepetitionPenalty,
    F::Logprobs,
    F::PromptLogprobs,
    F::IgnoreEos,
    F::SkipSpecialTokens,
    F::IncludeStopStrInOutput,
    F::LogitBias,
    F::AllowedTokenIds,
    F::MinTokens,
    F::BadWords,
]);

/// Top-level fields of the OpenAI-style endpoints (chat, completions, responses).
pub const COMMON: Mask = Mask::of(&[
    F::Model,
    F::Stream,
    F::StreamOptions,
    F::User,
    F::KvTransferParams,
    F::EcTransferParams,
    F::VllmXargs,
    F::MmProcessorKwargs,
    F::RequestId,
    F::CacheSalt,
]);

/// `/v1/chat/completions`.
pub const CHAT: Mask = COMMON.union(SAMPLING).union(Mask::of(&[
    F::Messages,
    F::ReturnTokenIds,
    F::StreamInterval,
    F::ContinueFinalMessage,
    F::TruncatePromptTokens,
    F::TruncationSide,
    F::MaxCompletionTokens,
    F::TopLogprobs,
    F::ChatTemplateKwargs,
    F::AddGenerationPrompt,
    F::Echo,
    F::ResponseFormat,
    F::StructuredOutputs,
    F::Tools,
    F::ToolChoice,
    F::ParallelToolCalls,
    F::MediaIoKwargs,
]));

/// `/v1/completions`.
pub const COMPLETIONS: Mask = COMMON.union(SAMPLING).union(Mask::of(&[
    F::Prompt,
    F::Echo,
    F::ReturnTokenIds,
    F::StreamInterval,
    F::TruncatePromptTokens,
    F::TruncationSide,
    F::ResponseFormat,
    F::StructuredOutputs,
]));

/// `/v1/responses` (no `n`, no `max_tokens`, logprobs through `top_logprobs`).
pub const RESPONSES: Mask = COMMON.union(Mask::of(&[
    F::Input,
    F::Include,
    F::Instructions,
    F::MaxOutputTokens,
    F::TopLogprobs,
    F::Temperature,
    F::TopP,
    F::TopK,
    F::MinP,
    F::Seed,
    F::Stop,
    F::StopTokenIds,
    F::PresencePenalty,
    F::FrequencyPenalty,
    F::RepetitionPenalty,
    F::IgnoreEos,
    F::SkipSpecialTokens,
    F::IncludeStopStrInOutput,
    F::ChatTemplateKwargs,
    F::LogitBias,
    F::StructuredOutputs,
    F::Text,
    F::Tools,
    F::ToolChoice,
    F::ParallelToolCalls,
    F::MediaIoKwargs,
]));

/// `/inference/v1/generate` top level.
pub const GENERATE: Mask = Mask::of(&[
    F::Model,
    F::RequestId,
    F::TokenIds,
    F::SamplingParams,
    F::Features,
    F::Stream,
    F::StreamOptions,
    F::KvTransferParams,
    F::EcTransferParams,
    F::VllmXargs,
    F::ReturnTokenIds,
    F::OutputMode,
]);

/// Generate's `sampling_params` object.
pub const GENERATE_SAMPLING: Mask = SAMPLING.union(Mask::of(&[F::ExtraArgs]));

/// Most unknown field names listed per request (they are for logs; a body with a
/// million unknown keys must not cost a million list entries or a quadratic scan).
pub const MAX_UNKNOWN_LISTED: usize = 64;

/// The known fields of one object (last occurrence wins), plus the unknown ones.
pub struct Fields<'v, 'a> {
    members: &'v Members<'a>,
    /// Index in `members` of each known field.
    slots: [Option<usize>; COUNT],
}

impl<'v, 'a> Fields<'v, 'a> {
    /// Sorts `members` into slots; names outside `mask` are appended to `unknown`
    /// (prefixed with `prefix` when the object is not the body itself), once each and
    /// at most [`MAX_UNKNOWN_LISTED`] in all.
    pub fn gather(
        members: &'v Members<'a>,
        mask: Mask,
        prefix: &Path<'_>,
        unknown: &mut Vec<String>,
    ) -> Self {
        let mut slots = [None; COUNT];
        for (i, (key, _)) in members.iter().enumerate() {
            match F::of(key) {
                Some(f) if mask.contains(f) => slots[f as usize] = Some(i),
                _ if unknown.len() >= MAX_UNKNOWN_LISTED => {}
                _ => {
                    let name = prefix.key(key).render();
                    if !unknown.contains(&name) {
                        unknown.push(name);
                    }
                }
            }
        }
        Self { members, slots }
    }

    /// The field's value (`null` included; see [`crate::fields::present`]).
    pub fn raw(&self, f: F) -> Option<&'v Value<'a>> {
        let members = self.members;
        self.slots[f as usize].map(|i| &members[i].1)
    }

    /// Where the field's value sits in the object's members.
    pub fn position(&self, f: F) -> Option<usize> {
        self.slots[f as usize]
    }

    /// The field's value unless absent or `null`.
    pub fn get(&self, f: F) -> Option<&'v Value<'a>> {
        crate::fields::present(self.raw(f))
    }
}

/// When a field vLLM accepts but this server does not apply is still harmless: its
/// value changes nothing (vLLM's default or a no-op).
#[derive(Debug, Clone, Copy)]
enum NoOp {
    /// Only `null`.
    Null,
    /// `null` or a boolean that reads as `false`.
    False,
    /// `null` or a boolean that reads as `true`.
    True,
    /// `null` or an integer equal to this.
    Int(i64),
    /// `null`, `[]` or `{}`.
    Empty,
    /// `null` or this string.
    Str(&'static str),
}

/// Which endpoints a refusal applies to.
const C: u8 = 1;
const P: u8 = 2;
const R: u8 = 4;
const G: u8 = 8;

/// Fields vLLM 0.33 accepts on chat (C), completions (P), Responses (R) or generate (G,
/// top level) that are not
/// applied here, with the value that leaves them harmless and the reason a different
/// value is refused. docs/compatibility.md lists the same table.
#[rustfmt::skip]
const UNSUPPORTED: &[(&str, u8, NoOp, &str)] = &[
    ("max_tool_calls", R, NoOp::Null, "a limit on tool calls is not supported"),
    ("reasoning_effort", C, NoOp::Null, "reasoning controls are not supported"),
    ("reasoning", R, NoOp::Null, "reasoning controls are not supported"),
    ("thinking_token_budget", C | P, NoOp::Null, "reasoning controls are not supported"),
    ("logprob_token_ids", C | P, NoOp::Null, "logprobs of chosen token ids are not supported"),
    ("truncation", R, NoOp::Str("disabled"), "prompt truncation is not supported yet"),
    ("use_beam_search", C | P, NoOp::False, "beam search is not supported"),
    ("watermarking", C | P | R, NoOp::False, "watermarking is not supported"),
    ("spaces_between_special_tokens", C | P | R, NoOp::True, "special tokens are always detokenized with spaces between them"),
    ("add_special_tokens", C, NoOp::False, "the chat template alone decides the special tokens"),
    ("add_special_tokens", P, NoOp::True, "the tokenizer always adds its special tokens"),
    ("documents", C, NoOp::Empty, "documents for the chat template are not supported"),
    ("chat_template", C, NoOp::Null, "the server's chat template cannot be replaced per request"),
    ("priority", C | P | R | G, NoOp::Int(0), "priority scheduling is not enabled (requests are served first come, first served, as vLLM's default fcfs policy serves them)"),
    ("return_tokens_as_token_ids", C | P, NoOp::False, "token ids as logprob tokens are not supported"),
    ("return_weight_versions", C | P, NoOp::False, "weight versions are not tracked"),
    ("routed_experts_prompt_start", C | P, NoOp::Int(0), "routed experts are not reported"),
    ("return_token_offsets", C | P, NoOp::False, "token offsets are not returned"),
    ("return_prompt_text", C, NoOp::False, "the prompt text is not returned"),
    ("mm_payload", C | P | R, NoOp::Str("tensors"), "multimodal payload options are not supported"),
    ("return_mm_kwargs", C | P | R, NoOp::False, "processed multimodal inputs are not returned"),
    ("repetition_detection", C | P, NoOp::Null, "repetition detection is not supported"),
    ("suffix", P, NoOp::Null, "suffix is not supported"),
    ("prompt_embeds", P, NoOp::Null, "prompt embeddings are not supported"),
    ("background", R, NoOp::False, "background responses are not supported"),
    ("previous_response_id", R, NoOp::Null, "responses are not stored"),
    ("previous_input_messages", R, NoOp::Null, "responses are not stored"),
    ("enable_response_messages", R, NoOp::False, "response messages are not returned"),
    ("prompt", R, NoOp::Null, "prompt templates are not supported"),
    ("prompt_cache_options", R, NoOp::Null, "prompt cache options are not supported"),
    ("prompt_cache_retention", R, NoOp::Null, "prompt cache retention is not supported"),
];

fn harmless(rule: NoOp, v: &Value<'_>) -> bool {
    use crate::fields::{boolean, integer};
    let at = Path::Root;
    let empty = |v: &Value<'_>| match v {
        Value::Array(items) => items.is_empty(),
        Value::Object(members) => members.is_empty(),
        _ => false,
    };
    matches!(v, Value::Null)
        || match rule {
            NoOp::Null => false,
            NoOp::False => boolean(v, &at).is_ok_and(|b| !b),
            NoOp::True => boolean(v, &at).is_ok_and(|b| b),
            NoOp::Int(i) => integer(v, &at).is_ok_and(|n| n == i),
            NoOp::Empty => empty(v),
            NoOp::Str(s) => matches!(v, Value::String(x) if x == s),
        }
}

/// The first field of `members` that vLLM would apply on `endpoint` and this server
/// does not, with a value that is not harmless: its name and the reason.
pub fn unsupported(
    endpoint: crate::request::Endpoint,
    members: &Members<'_>,
) -> Option<(String, &'static str)> {
    use crate::request::Endpoint;
    let bit = match endpoint {
        Endpoint::Chat => C,
        Endpoint::Completions => P,
        Endpoint::Responses => R,
        Endpoint::Generate => G,
    };
    members.iter().find_map(|(key, v)| {
        UNSUPPORTED
            .iter()
            .find(|(name, on, rule, _)| name == key && on & bit != 0 && !harmless(*rule, v))
            .map(|&(name, _, _, reason)| (name.to_owned(), reason))
    })
}
