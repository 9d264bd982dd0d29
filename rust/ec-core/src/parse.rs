//! The one entry point: body bytes of an endpoint -> [`ParsedRequest`].

use std::collections::{HashMap, HashSet};

use crate::content::{chat_messages, responses_input};
use crate::error::{RequestError, Result};
use crate::fields::{
    array, check_object, integer_in, missing, object, opt_bool, opt_object, opt_string, present,
    string, token_id, type_error, value_error, Members,
};
use crate::fieldset::{self, Fields, F};
use crate::json::parse_body;
use crate::limits::Limits;
use crate::media::is_valid_mm_hash;
use crate::media_items::MediaCollector;
use crate::merge::{merge_transfer_params_owned, EC_KEY, KV_KEY};
use crate::path::{Path, ROOT};
use crate::request::{Endpoint, Features, ParsedRequest, Placeholder, Prompt};
use crate::sampling::{sampling_params, stream_flags, LengthFields, LogprobStyle};
use crate::value::Value;

/// Parses and validates one request body.
///
/// `model_id` enters every content hash, so all instances of a deployment must pass
/// the same value. Nothing here panics on any input; every rejection is a
/// [`RequestError`].
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    model_id: &str,
    limits: &Limits,
) -> Result<ParsedRequest> {
    let mut root = parse_body(body, limits)?;
    let members = match &mut root {
        Value::Object(members) => members,
        other => {
            return Err(RequestError::InvalidType {
                param: String::new(),
                expected: "a JSON object",
                found: other.type_name(),
            })
        }
    };
    let mask = match endpoint {
        Endpoint::Chat => fieldset::CHAT,
        Endpoint::Completions => fieldset::COMPLETIONS,
        Endpoint::Responses => fieldset::RESPONSES,
        Endpoint::Generate => fieldset::GENERATE,
    };
    let mut req = ParsedRequest::new(endpoint);
    let fields = Fields::gather(members, mask, &ROOT, &mut req.unknown_fields);
    if let Some((name, reason)) = fieldset::unsupported(endpoint, members) {
        let path = ROOT.key(&name);
        return Err(value_error(
            &path,
            format!("'{name}' is not supported: {reason}"),
        ));
    }

    req.model = opt_string(fields.raw(F::Model), &ROOT.key("model"))?;
    req.user = opt_string(fields.raw(F::User), &ROOT.key("user"))?;
    req.request_id = opt_string(fields.raw(F::RequestId), &ROOT.key("request_id"))?;
    (req.stream, req.include_usage, req.continuous_usage_stats) = stream_flags(&fields)?;
    req.return_token_ids = opt_bool(
        fields.raw(F::ReturnTokenIds),
        &ROOT.key("return_token_ids"),
        false,
    )?;
    if let Some(v) = fields.get(F::StreamInterval) {
        req.stream_interval = integer_in(v, &ROOT.key("stream_interval"), 1, i64::MAX)? as u64;
    }
    if let Some(v) = fields.get(F::OutputMode) {
        req.output_mode = output_mode(v)?;
    }
    // The object-valued fields are checked here and moved out of the tree at the end
    // (no copy of their containers); until then they are read in place.
    let mut kept = [None; OBJECT_FIELDS.len()];
    let mut keep = |slot: usize| -> Result<()> {
        let (f, name) = OBJECT_FIELDS[slot];
        if check_object(fields.raw(f), &ROOT.key(name))? {
            kept[slot] = fields.position(f);
        }
        Ok(())
    };
    (0..4).try_for_each(&mut keep)?;
    req.add_generation_prompt = opt_bool(
        fields.raw(F::AddGenerationPrompt),
        &ROOT.key("add_generation_prompt"),
        true,
    )?;
    req.echo = opt_bool(fields.raw(F::Echo), &ROOT.key("echo"), false)?;
    req.continue_final_message = opt_bool(
        fields.raw(F::ContinueFinalMessage),
        &ROOT.key("continue_final_message"),
        false,
    )?;
    if req.continue_final_message && req.add_generation_prompt {
        // vLLM refuses the pair (its validator when both are sent, the chat template
        // when add_generation_prompt keeps its default).
        return Err(value_error(
            &ROOT.key("continue_final_message"),
            "cannot set both 'continue_final_message' and 'add_generation_prompt' to true \
             (add_generation_prompt defaults to true: send false with continue_final_message)",
        ));
    }
    if let Some(v) = fields.get(F::TruncatePromptTokens) {
        req.truncate_prompt_tokens = Some(integer_in(
            v,
            &ROOT.key("truncate_prompt_tokens"),
            -1,
            i64::MAX,
        )?);
    }
    if let Some(v) = fields.get(F::TruncationSide) {
        let path = ROOT.key("truncation_side");
        req.truncation_side = Some(match string(v, &path)? {
            "left" => "left",
            "right" => "right",
            _ => {
                return Err(value_error(
                    &path,
                    "'truncation_side' must be either 'left' or 'right'",
                ))
            }
        });
    }
    if req.echo && endpoint == Endpoint::Chat {
        return Err(value_error(
            &ROOT.key("echo"),
            "'echo' is not supported on chat completions",
        ));
    }
    keep(4)?;

    keep(5)?;

    let cache_salt = cache_salt(fields.raw(F::CacheSalt))?;
    req.cache_salt = cache_salt.map(str::to_owned);
    let mut media = MediaCollector::new(
        limits,
        model_id,
        fields.get(F::MmProcessorKwargs),
        cache_salt,
        video_options(fields.get(F::MediaIoKwargs))?,
    );
    let mut extra_args = None;
    match endpoint {
        Endpoint::Chat => {
            let p = ROOT.key("messages");
            let v = fields.get(F::Messages).ok_or_else(|| missing(&p))?;
            req.messages = Some(chat_messages(v, &p, limits, &mut media)?);
            req.sampling = sampling_params(
                &fields,
                &ROOT,
                LogprobStyle::Chat,
                LengthFields {
                    fields: &[F::MaxCompletionTokens, F::MaxTokens],
                    default: None,
                },
                req.echo,
                req.stream,
            )?;
        }
        Endpoint::Responses => {
            req.instructions = opt_string(fields.raw(F::Instructions), &ROOT.key("instructions"))?;
            let p = ROOT.key("input");
            let v = fields.get(F::Input).ok_or_else(|| missing(&p))?;
            req.messages = Some(responses_input(
                v,
                &p,
                req.instructions.as_deref(),
                limits,
                &mut media,
            )?);
            req.sampling = sampling_params(
                &fields,
                &ROOT,
                LogprobStyle::Responses(include_logprobs(fields.get(F::Include))?),
                LengthFields {
                    fields: &[F::MaxOutputTokens],
                    default: None,
                },
                false,
                req.stream,
            )?;
        }
        Endpoint::Completions => {
            let p = ROOT.key("prompt");
            let v = fields.get(F::Prompt).ok_or_else(|| missing(&p))?;
            req.prompts = Some(prompts(v, &p, limits)?);
            req.sampling = sampling_params(
                &fields,
                &ROOT,
                LogprobStyle::Count,
                LengthFields {
                    fields: &[F::MaxTokens],
                    default: Some(16),
                },
                req.echo,
                req.stream,
            )?;
        }
        Endpoint::Generate => {
            let p = ROOT.key("token_ids");
            let v = fields.get(F::TokenIds).ok_or_else(|| missing(&p))?;
            let ids = token_ids(v, &p, limits)?;
            if ids.is_empty() {
                return Err(value_error(&p, "'token_ids' must not be empty"));
            }
            let sp = ROOT.key("sampling_params");
            let empty = Vec::new();
            let sp_members = match fields.get(F::SamplingParams) {
                Some(v) => object(v, &sp)?,
                None => &empty[..],
            };
            let sfields = Fields::gather(
                sp_members,
                fieldset::GENERATE_SAMPLING,
                &sp,
                &mut req.unknown_fields,
            );
            req.sampling = sampling_params(
                &sfields,
                &sp,
                LogprobStyle::Count,
                // As vLLM: a generate request that gives no max_tokens may use the
                // rest of the context.
                LengthFields {
                    fields: &[F::MaxTokens],
                    default: None,
                },
                false,
                req.stream,
            )?;
            if req.sampling.n != 1 {
                return Err(value_error(
                    &sp.key("n"),
                    "the generate endpoint serves one sequence per request: 'n' must be 1",
                ));
            }
            extra_args = opt_object(sfields.raw(F::ExtraArgs), &sp.key("extra_args"))?;
            if let Some(v) = fields.get(F::Features) {
                req.features = Some(features(v, &ROOT.key("features"), ids.len())?);
            }
            req.token_ids = Some(ids);
        }
    }
    if endpoint != Endpoint::Generate {
        req.structured = crate::structured::structured(&fields, endpoint)?;
    }
    req.media = media.items;

    let mut take = |i: usize| {
        kept[i].map(|at| std::mem::replace(&mut members[at].1, Value::Null).into_owned())
    };
    let [kv_transfer_params, ec_transfer_params, mm_processor_kwargs, chat_template_kwargs, xargs, media_io_kwargs] =
        std::array::from_fn(&mut take);
    req.mm_processor_kwargs = mm_processor_kwargs;
    req.media_io_kwargs = media_io_kwargs;
    req.chat_template_kwargs = chat_template_kwargs;
    let base_xargs = match (extra_args, xargs) {
        (Some(Value::Object(mut inner)), Some(Value::Object(top))) => {
            let named: HashSet<&str> = top.iter().map(|(k, _)| k.as_ref()).collect();
            inner.retain(|(k, _)| !named.contains(k.as_ref()));
            drop(named);
            inner.extend(top);
            Some(Value::Object(inner))
        }
        (extra, top) => top.or(extra),
    };
    req.has_kv_transfer_params = kv_transfer_params.is_some();
    req.has_ec_transfer_params = ec_transfer_params.is_some();
    let merged = merge_transfer_params_owned(base_xargs, kv_transfer_params, KV_KEY);
    req.sampling.extra_args = merge_transfer_params_owned(merged, ec_transfer_params, EC_KEY);
    Ok(req)
}

/// The top-level fields kept as owned objects, in the order they are checked.
const OBJECT_FIELDS: [(F, &str); 6] = [
    (F::KvTransferParams, "kv_transfer_params"),
    (F::EcTransferParams, "ec_transfer_params"),
    (F::MmProcessorKwargs, "mm_processor_kwargs"),
    (F::ChatTemplateKwargs, "chat_template_kwargs"),
    (F::VllmXargs, "vllm_xargs"),
    (F::MediaIoKwargs, "media_io_kwargs"),
];

/// The largest `media_io_kwargs.video.num_frames` accepted here (the server's
/// `--max-video-frames` is the real bound, checked before decoding).
pub const MAX_NUM_FRAMES: i64 = 1 << 20;

/// vLLM's `media_io_kwargs` (already checked to be an object): its `video` entry holds
/// `num_frames` (an integer; 0 or less: every frame) and `fps` (a number; 0 or less: the
/// source rate), as vLLM's video loader reads them. An `image` entry must be empty
/// (vLLM's image loader takes no per-request options this server applies); anything
/// else is refused with its path. Returns the `video` object, which enters every video
/// key.
fn video_options<'v, 'a>(v: Option<&'v Value<'a>>) -> Result<Option<&'v Value<'a>>> {
    let path = ROOT.key("media_io_kwargs");
    let Some(v) = v else { return Ok(None) };
    let mut video = None;
    for (key, value) in object(v, &path)? {
        let at = path.key(key);
        match key.as_ref() {
            "video" => {
                for (name, option) in object(value, &at)? {
                    let op = at.key(name);
                    match name.as_ref() {
                        "num_frames" => {
                            integer_in(option, &op, -1, MAX_NUM_FRAMES)?;
                        }
                        "fps" => {
                            crate::fields::number_in(option, &op, -1.0e6, 1.0e6, false)?;
                        }
                        other => {
                            return Err(value_error(
                                &op,
                                format!(
                                    "unsupported video option '{}': expected num_frames or fps",
                                    crate::content::clip(other)
                                ),
                            ))
                        }
                    }
                }
                video = Some(value);
            }
            "image" if matches!(value, Value::Object(m) if m.is_empty()) => {}
            other => {
                return Err(value_error(
                    &at,
                    format!(
                        "unsupported media_io_kwargs entry '{}': only 'video' (num_frames, fps) \
                         is applied",
                        crate::content::clip(other)
                    ),
                ))
            }
        }
    }
    Ok(video)
}

/// The extra Responses outputs vLLM 0.33 knows; only the output text's logprobs are
/// served here.
const INCLUDABLE: [&str; 6] = [
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
];

/// Responses' `include`: whether it asks for the output text's logprobs; any other
/// output it names is refused.
fn include_logprobs(v: Option<&Value<'_>>) -> Result<bool> {
    let path = ROOT.key("include");
    let Some(v) = v else { return Ok(false) };
    let mut logprobs = false;
    for (i, item) in array(v, &path)?.iter().enumerate() {
        let at = path.index(i);
        match string(item, &at)? {
            "message.output_text.logprobs" => logprobs = true,
            other if INCLUDABLE.contains(&other) => {
                return Err(value_error(
                    &path,
                    format!("'include' of {other:?} is not supported: only \"message.output_text.logprobs\""),
                ))
            }
            other => {
                return Err(value_error(
                    &at,
                    format!("{other:?} is not an output vLLM's Responses API can include"),
                ))
            }
        }
    }
    Ok(logprobs)
}

/// Generate's `output_mode`; `derender` needs a chat parser this server does not have.
fn output_mode(v: &Value<'_>) -> Result<&'static str> {
    let path = ROOT.key("output_mode");
    match string(v, &path)? {
        "tokens" => Ok("tokens"),
        "text" => Ok("text"),
        "derender" => Err(value_error(
            &path,
            "output_mode 'derender' is not supported: use 'text' or 'tokens'",
        )),
        other => Err(value_error(
            &path,
            format!("output_mode must be 'tokens', 'text' or 'derender', got {other:?}"),
        )),
    }
}

/// vLLM's rule for `cache_salt`: absent, `null` or a non-empty string.
fn cache_salt<'v>(v: Option<&'v Value<'_>>) -> Result<Option<&'v str>> {
    let path = ROOT.key("cache_salt");
    match present(v).map(|v| string(v, &path)).transpose()? {
        Some("") => Err(value_error(
            &path,
            "'cache_salt' must be a non-empty string if provided",
        )),
        salt => Ok(salt),
    }
}

fn token_ids(v: &Value<'_>, path: &Path<'_>, limits: &Limits) -> Result<Vec<u32>> {
    let items = array(v, path)?;
    if items.len() > limits.max_token_ids {
        return Err(token_limit(path, items.len(), limits));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| token_id(t, &path.index(i)))
        .collect()
}

fn token_limit(path: &Path<'_>, n: usize, limits: &Limits) -> RequestError {
    RequestError::LimitExceeded {
        param: Some(path.render()),
        message: format!(
            "'{path}' has {n} token ids, over the limit of {}",
            limits.max_token_ids
        ),
    }
}

fn prompts(v: &Value<'_>, path: &Path<'_>, limits: &Limits) -> Result<Vec<Prompt>> {
    let empty = || value_error(path, "'prompt' must not be empty");
    match v {
        Value::String(s) => Ok(vec![Prompt::Text(s.to_string())]),
        Value::Array(items) if items.is_empty() => Err(empty()),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .enumerate()
                .map(|(i, s)| string(s, &path.index(i)).map(|s| Prompt::Text(s.to_owned())))
                .collect(),
            Value::Array(_) => {
                let mut total = 0;
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let p = path.index(i);
                    let ids = token_ids(item, &p, limits)?;
                    if ids.is_empty() {
                        return Err(value_error(&p, format!("'{p}' must not be empty")));
                    }
                    total += ids.len();
                    if total > limits.max_token_ids {
                        return Err(token_limit(path, total, limits));
                    }
                    out.push(Prompt::Tokens(ids));
                }
                Ok(out)
            }
            _ => Ok(vec![Prompt::Tokens(token_ids(v, path, limits)?)]),
        },
        other => Err(type_error(
            path,
            "a string, an array of strings, an array of token ids or an array of such arrays",
            other,
        )),
    }
}

/// Generate's `features`: vLLM's per-modality form (`mm_hashes: {"image": [...]}`,
/// `mm_placeholders: {"image": [...]}`, optional `kwargs_data` / `mm_metadata` whose
/// entries must be `null` here, plus this server's `mm_grid_thw: {"image": [[t, h, w]]}`),
/// or this server's earlier flat lists. Items come out in prompt order.
fn features(v: &Value<'_>, path: &Path<'_>, num_tokens: usize) -> Result<Features> {
    object(v, path)?;
    let hp = path.key("mm_hashes");
    let hashes = present(v.get("mm_hashes")).ok_or_else(|| missing(&hp))?;
    let mut items = if matches!(hashes, Value::Object(_)) {
        modality_items(v, path, num_tokens)?
    } else {
        flat_items(v, path, num_tokens)?
    };
    if items.iter().any(|i| i.2.is_some()) && items.iter().any(|i| i.2.is_none()) {
        return Err(value_error(
            &path.key("mm_grid_thw"),
            "'mm_grid_thw' must list a grid for every item or for none",
        ));
    }
    items.sort_by_key(|i| i.1.offset);
    for pair in items.windows(2) {
        if pair[1].1.offset < pair[0].1.offset + pair[0].1.length {
            return Err(value_error(
                &path.key("mm_placeholders"),
                "placeholders must not overlap",
            ));
        }
    }
    let has_grid = items.first().is_some_and(|i| i.2.is_some());
    Ok(Features {
        mm_hashes: items.iter().map(|i| i.0.clone()).collect(),
        mm_placeholders: items.iter().map(|i| i.1).collect(),
        mm_grid_thw: has_grid.then(|| items.iter().filter_map(|i| i.2).collect()),
    })
}

/// One item: its hash, placeholder and grid.
type Item = (String, Placeholder, Option<[u32; 3]>);

/// The modalities the generate endpoint takes.
const MODALITIES: [&str; 1] = ["image"];

fn modality_items(v: &Value<'_>, path: &Path<'_>, num_tokens: usize) -> Result<Vec<Item>> {
    let hp = path.key("mm_hashes");
    let pp = path.key("mm_placeholders");
    let hashes = object(
        present(v.get("mm_hashes")).ok_or_else(|| missing(&hp))?,
        &hp,
    )?;
    let places = object(
        present(v.get("mm_placeholders")).ok_or_else(|| missing(&pp))?,
        &pp,
    )?;
    // Keys are compared through a set and looked up through maps (each key's first
    // member, as a scan would find it): a scan per key would cost the square of a map
    // of many modalities.
    let modalities: HashSet<&str> = hashes.iter().map(|(k, _)| k.as_ref()).collect();
    let same_keys = |other: &Members<'_>| {
        other.len() == hashes.len() && other.iter().all(|(k, _)| modalities.contains(k.as_ref()))
    };
    if !same_keys(places) {
        return Err(value_error(
            &pp,
            "mm_hashes and mm_placeholders must use the same modalities",
        ));
    }
    let grids = match present(v.get("mm_grid_thw")) {
        None => None,
        Some(g) => Some(first_members(object(g, &path.key("mm_grid_thw"))?)),
    };
    let places_of = first_members(places);
    for name in ["kwargs_data", "mm_metadata"] {
        let Some(data) = present(v.get(name)) else {
            continue;
        };
        let dp = path.key(name);
        let members = object(data, &dp)?;
        if !same_keys(members) {
            return Err(value_error(
                &dp,
                format!("'{name}' must use the same modalities as mm_hashes"),
            ));
        }
        for (modality, list) in members {
            let lp = dp.key(modality);
            for (i, entry) in array(list, &lp)?.iter().enumerate() {
                if !matches!(entry, Value::Null) {
                    return Err(value_error(
                        &lp.index(i),
                        "serialized multimodal items are not supported: send null here, the \
                         item's grid in 'features.mm_grid_thw' and its encoder output through \
                         ec_transfer_params",
                    ));
                }
            }
        }
    }
    let gp_root = path.key("mm_grid_thw");
    let mut items = Vec::new();
    for (modality, list) in hashes {
        let mp = hp.key(modality);
        if !MODALITIES.contains(&modality.as_ref()) {
            return Err(value_error(
                &mp,
                format!("modality '{modality}' is not supported (only 'image')"),
            ));
        }
        let list = array(list, &mp)?;
        let lp = pp.key(modality);
        let place_list = array(
            places_of
                .get(modality.as_ref())
                .copied()
                .ok_or_else(|| missing(&lp))?,
            &lp,
        )?;
        if place_list.len() != list.len() {
            return Err(value_error(
                &lp,
                format!("{modality} mm_hashes and mm_placeholders must have the same length"),
            ));
        }
        let gp = gp_root.key(modality);
        let grid_list = match &grids {
            None => None,
            Some(g) => {
                let rows = g.get(modality.as_ref()).copied();
                let rows = array(rows.ok_or_else(|| missing(&gp))?, &gp)?;
                if rows.len() != list.len() {
                    return Err(value_error(
                        &gp,
                        format!(
                            "'{gp}' has {} entries but mm_hashes has {}",
                            rows.len(),
                            list.len()
                        ),
                    ));
                }
                Some(rows)
            }
        };
        for (i, h) in list.iter().enumerate() {
            let grid = grid_list
                .map(|rows| grid_row(&rows[i], &gp.index(i)))
                .transpose()?;
            items.push((
                mm_hash(h, &mp.index(i))?,
                placeholder(&place_list[i], &lp.index(i), num_tokens)?,
                grid,
            ));
        }
    }
    Ok(items)
}

/// An object's members by key, the first member of a repeated key kept.
fn first_members<'v, 'a>(members: &'v Members<'a>) -> HashMap<&'v str, &'v Value<'a>> {
    let mut by_key = HashMap::with_capacity(members.len());
    for (k, v) in members {
        by_key.entry(k.as_ref()).or_insert(v);
    }
    by_key
}

fn flat_items(v: &Value<'_>, path: &Path<'_>, num_tokens: usize) -> Result<Vec<Item>> {
    let hp = path.key("mm_hashes");
    let hashes = array(
        present(v.get("mm_hashes")).ok_or_else(|| missing(&hp))?,
        &hp,
    )?;
    let pp = path.key("mm_placeholders");
    let places = array(
        present(v.get("mm_placeholders")).ok_or_else(|| missing(&pp))?,
        &pp,
    )?;
    if places.len() != hashes.len() {
        return Err(value_error(
            &pp,
            format!(
                "'{pp}' has {} entries but 'mm_hashes' has {}",
                places.len(),
                hashes.len()
            ),
        ));
    }
    let gp = path.key("mm_grid_thw");
    let grids = match present(v.get("mm_grid_thw")) {
        None => None,
        Some(g) => {
            let rows = array(g, &gp)?;
            if rows.len() != hashes.len() {
                return Err(value_error(
                    &gp,
                    format!(
                        "'{gp}' has {} entries but 'mm_hashes' has {}",
                        rows.len(),
                        hashes.len()
                    ),
                ));
            }
            Some(rows)
        }
    };
    let mut items = Vec::with_capacity(hashes.len());
    let mut end_of_previous = 0;
    for (i, h) in hashes.iter().enumerate() {
        let p = pp.index(i);
        let place = placeholder(&places[i], &p, num_tokens)?;
        if place.offset < end_of_previous {
            return Err(value_error(
                &p,
                "placeholders must be sorted and must not overlap",
            ));
        }
        end_of_previous = place.offset.saturating_add(place.length);
        let grid = grids
            .map(|rows| grid_row(&rows[i], &gp.index(i)))
            .transpose()?;
        items.push((mm_hash(h, &hp.index(i))?, place, grid));
    }
    Ok(items)
}

fn mm_hash(h: &Value<'_>, p: &Path<'_>) -> Result<String> {
    let h = string(h, p)?;
    if !is_valid_mm_hash(h) {
        return Err(value_error(
            p,
            "an mm_hash must be lower-case hex of 1 to 128 characters",
        ));
    }
    Ok(h.to_owned())
}

fn placeholder(place: &Value<'_>, p: &Path<'_>, num_tokens: usize) -> Result<Placeholder> {
    object(place, p)?;
    let op = p.key("offset");
    let lp = p.key("length");
    let offset = integer_in(
        present(place.get("offset")).ok_or_else(|| missing(&op))?,
        &op,
        0,
        i64::MAX,
    )? as usize;
    let length = integer_in(
        present(place.get("length")).ok_or_else(|| missing(&lp))?,
        &lp,
        1,
        i64::MAX,
    )? as usize;
    if offset.saturating_add(length) > num_tokens {
        return Err(value_error(
            p,
            format!(
                "placeholder [{offset}, {offset}+{length}) runs past the {num_tokens} token ids"
            ),
        ));
    }
    Ok(Placeholder { offset, length })
}

fn grid_row(row: &Value<'_>, rp: &Path<'_>) -> Result<[u32; 3]> {
    let cells = array(row, rp)?;
    if cells.len() != 3 {
        return Err(value_error(rp, format!("'{rp}' must be [t, h, w]")));
    }
    let mut thw = [0u32; 3];
    for (j, c) in cells.iter().enumerate() {
        thw[j] = integer_in(c, &rp.index(j), 1, i64::from(u16::MAX))? as u32;
    }
    Ok(thw)
}
