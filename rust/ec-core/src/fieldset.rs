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
}

const COUNT: usize = F::CacheSalt as usize + 1;

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
    F::MaxCompletionTokens,
    F::TopLogprobs,
    F::ChatTemplateKwargs,
    F::AddGenerationPrompt,
    F::Echo,
]));

/// `/v1/completions`.
pub const COMPLETIONS: Mask = COMMON
    .union(SAMPLING)
    .union(Mask::of(&[F::Prompt, F::Echo]));

/// `/v1/responses` (no `n`, no `max_tokens`, logprobs through `top_logprobs`).
pub const RESPONSES: Mask = COMMON.union(Mask::of(&[
    F::Input,
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
