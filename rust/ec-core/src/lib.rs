//! The protocol core of ec-frontend: request parsing and validation for the chat,
//! completions, responses and generate endpoints, transfer-param merging, data-URL
//! decoding and media keys. No Python here; `ec-py` is the bindings.
//!
//! Entry point: [`parse_request`].

mod content;
pub mod error;
pub mod fields;
mod fieldset;
pub mod json;
pub mod limits;
pub mod media;
mod media_items;
pub mod merge;
mod parse;
pub mod path;
pub mod preprocess;
pub mod request;
pub mod sampling;
pub mod structured;
pub mod value;

pub use content::{EmbedsMeta, MAX_SECOND_PER_GRID_T};
pub use error::RequestError;
pub use json::{parse_body, parse_str};
pub use limits::Limits;
pub use media::{compute_mm_hash, decode_data_url, is_valid_mm_hash, DataUrl, KeyScope, MediaKind};
pub use merge::{merge_ec_transfer_params, merge_kv_transfer_params, merge_transfer_params};
pub use parse::parse_request;
pub use request::{
    Endpoint, Features, MediaItem, Message, ParsedRequest, Part, Placeholder, Prompt, Role,
    SamplingParams,
};
pub use value::{Number, OwnedValue, Value};
