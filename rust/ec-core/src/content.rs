//! Chat `messages` and responses `input` -> [`Message`]s with media collected.

use crate::error::{RequestError, Result};
use crate::fields::{
    array, integer_in, missing, object, present, range_error, string, type_error, value_error,
};
use crate::limits::Limits;
use crate::media::MediaKind;
use crate::media_items::MediaCollector;
use crate::path::Path;
use crate::request::{Message, Part, Role};
use crate::value::{Number, Value};

fn role(v: Option<&Value<'_>>, path: &Path<'_>) -> Result<Role> {
    let v = present(v).ok_or_else(|| missing(path))?;
    match string(v, path)? {
        "system" | "developer" => Ok(Role::System),
        "user" => Ok(Role::User),
        "assistant" => Ok(Role::Assistant),
        "tool" => Ok(Role::Tool),
        other => Err(value_error(
            path,
            format!(
                "unsupported role '{}': expected system, developer, user, assistant or tool",
                clip(other)
            ),
        )),
    }
}

/// At most 40 characters of user text, for messages.
pub fn clip(s: &str) -> String {
    s.chars().take(40).collect()
}

fn check_count(n: usize, limits: &Limits, path: &Path<'_>) -> Result<()> {
    if n == 0 {
        return Err(value_error(path, format!("'{path}' must not be empty")));
    }
    if n > limits.max_messages {
        return Err(RequestError::LimitExceeded {
            param: Some(path.render()),
            message: format!(
                "'{path}' has {n} messages, over the limit of {}",
                limits.max_messages
            ),
        });
    }
    Ok(())
}

fn opt_uuid<'v>(part: &'v Value<'_>, path: &Path<'_>) -> Result<Option<&'v str>> {
    present(part.get("uuid"))
        .map(|u| string(u, &path.key("uuid")))
        .transpose()
}

/// Chat `messages`.
pub fn chat_messages(
    v: &Value<'_>,
    path: &Path<'_>,
    limits: &Limits,
    media: &mut MediaCollector<'_>,
) -> Result<Vec<Message>> {
    let items = array(v, path)?;
    check_count(items.len(), limits, path)?;
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let mp = path.index(i);
        object(m, &mp)?;
        let role = role(m.get("role"), &mp.key("role"))?;
        let cp = mp.key("content");
        let tool_calls = match present(m.get("tool_calls")) {
            Some(v) if role == Role::Assistant => Some(tool_calls(v, &mp.key("tool_calls"))?),
            _ => None,
        };
        let content = match present(m.get("content")) {
            None if role == Role::Assistant => Vec::new(),
            None => return Err(missing(&cp)),
            Some(v) => content_parts(v, &cp, media, chat_part)?,
        };
        let tool_call_id = match present(m.get("tool_call_id")) {
            Some(v) if role == Role::Tool => Some(string(v, &mp.key("tool_call_id"))?.to_owned()),
            _ => None,
        };
        out.push(Message {
            role,
            content,
            tool_calls,
            tool_call_id,
        });
    }
    Ok(out)
}

/// An assistant message's `tool_calls`: each `{"id", "type": "function", "function":
/// {"name", "arguments"}}` with `arguments` a string (JSON, as OpenAI sends it).
fn tool_calls(v: &Value<'_>, path: &Path<'_>) -> Result<crate::value::OwnedValue> {
    for (i, call) in array(v, path)?.iter().enumerate() {
        let cp = path.index(i);
        object(call, &cp)?;
        if let Some(id) = present(call.get("id")) {
            string(id, &cp.key("id"))?;
        }
        if let Some(t) = present(call.get("type")) {
            let tp = cp.key("type");
            if string(t, &tp)? != "function" {
                return Err(value_error(&tp, "a tool call's type must be 'function'"));
            }
        }
        let fp = cp.key("function");
        let f = present(call.get("function")).ok_or_else(|| missing(&fp))?;
        object(f, &fp)?;
        let np = fp.key("name");
        string(present(f.get("name")).ok_or_else(|| missing(&np))?, &np)?;
        let ap = fp.key("arguments");
        string(
            present(f.get("arguments")).ok_or_else(|| missing(&ap))?,
            &ap,
        )?;
    }
    Ok(v.to_owned_value())
}

/// A message's `content`: a string (one text part) or an array of parts, each read by
/// `part` (the chat and the responses APIs name their part types differently).
fn content_parts(
    v: &Value<'_>,
    path: &Path<'_>,
    media: &mut MediaCollector<'_>,
    part: fn(&Value<'_>, &Path<'_>, &mut MediaCollector<'_>) -> Result<Part>,
) -> Result<Vec<Part>> {
    match v {
        Value::String(s) => Ok(vec![Part::Text {
            text: s.to_string(),
        }]),
        Value::Array(parts) => {
            let mut content = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                content.push(part(p, &path.index(j), media)?);
            }
            Ok(content)
        }
        other => Err(type_error(
            path,
            "a string or an array of content parts",
            other,
        )),
    }
}

fn chat_part(part: &Value<'_>, path: &Path<'_>, media: &mut MediaCollector<'_>) -> Result<Part> {
    object(part, path)?;
    let tp = path.key("type");
    let kind = string(present(part.get("type")).ok_or_else(|| missing(&tp))?, &tp)?;
    match kind {
        "text" => {
            let p = path.key("text");
            let text = string(present(part.get("text")).ok_or_else(|| missing(&p))?, &p)?;
            Ok(Part::Text {
                text: text.to_owned(),
            })
        }
        "image_url" => {
            let index = url_part(part, path, "image_url", MediaKind::Image, media)?;
            Ok(Part::Image { media_index: index })
        }
        "video_url" => {
            let index = url_part(part, path, "video_url", MediaKind::Video, media)?;
            Ok(Part::Video { media_index: index })
        }
        "image_embeds" => {
            let index = embeds_part(part, path, MediaKind::Image, media)?;
            Ok(Part::Image { media_index: index })
        }
        "video_embeds" => {
            let index = embeds_part(part, path, MediaKind::Video, media)?;
            Ok(Part::Video { media_index: index })
        }
        other => Err(value_error(
            &tp,
            format!(
                "unsupported content part type '{}': expected text, image_url, video_url, image_embeds or video_embeds",
                clip(other)
            ),
        )),
    }
}

/// The media item of an `image_url` / `video_url` part: `part[field]` is an object with
/// a `url` (or the URL itself), the optional `uuid` sits beside `type`.
fn url_part(
    part: &Value<'_>,
    path: &Path<'_>,
    field: &str,
    kind: MediaKind,
    media: &mut MediaCollector<'_>,
) -> Result<usize> {
    let ip = path.key(field);
    let value = present(part.get(field)).ok_or_else(|| missing(&ip))?;
    let up = ip.key("url");
    let url = match value {
        Value::String(s) => s.as_ref(),
        Value::Object(_) => string(present(value.get("url")).ok_or_else(|| missing(&up))?, &up)?,
        other => return Err(type_error(&ip, "an object with a 'url'", other)),
    };
    let url_path = if matches!(value, Value::String(_)) {
        ip
    } else {
        up
    };
    let uuid = opt_uuid(part, path)?;
    media.add_url_item(kind, url, uuid, &ip, &url_path, &path.key("uuid"))
}

/// The media item of a metadata-only reference (vLLM's `image_embeds` / `video_embeds`
/// part): `part["<kind>_embeds"]` holds the grid, the `uuid` its encoder was given sits
/// beside `type`.
fn embeds_part(
    part: &Value<'_>,
    path: &Path<'_>,
    kind: MediaKind,
    media: &mut MediaCollector<'_>,
) -> Result<usize> {
    let field = match kind {
        MediaKind::Image => "image_embeds",
        MediaKind::Video => "video_embeds",
    };
    let ep = path.key(field);
    let up = path.key("uuid");
    let meta = embeds_meta(part.get(field), &ep, kind)?;
    let uuid = opt_uuid(part, path)?.ok_or_else(|| {
        value_error(
            &up,
            format!("an '{field}' part needs the 'uuid' its encoder was given"),
        )
    })?;
    media.add_embeds(kind, uuid, meta, &ep, &up)
}

/// The largest grid side accepted in an `image_embeds` / `video_embeds` reference (in
/// patches); the model checks the grid against its own pixel and frame range.
pub const MAX_GRID_SIDE: i64 = 1 << 16;

/// The largest `second_per_grid_ts` accepted in a `video_embeds` reference (a day, in
/// seconds); the model checks it against its own duration limit.
pub const MAX_SECOND_PER_GRID_T: f64 = 86_400.0;

/// What a metadata-only reference says about its item.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedsMeta {
    /// The `[t, h, w]` patch grid its encoder reported.
    pub grid_thw: [u32; 3],
    /// A video's seconds per temporal patch (vLLM's `second_per_grid_ts`), when given.
    pub second_per_grid_ts: Option<f64>,
    /// A video's time of each temporal patch in seconds (vLLM's `timestamps`, which
    /// Qwen3-VL writes into the prompt), when given: `t` of them.
    pub timestamps: Option<Vec<f64>>,
}

/// The metadata of an `image_embeds` (`video_embeds`) part: an object holding
/// `image_grid_thw` (`video_grid_thw`): three positive integers, or one such triple in
/// a list; a video's may also hold `second_per_grid_ts`: one finite number in
/// `(0, MAX_SECOND_PER_GRID_T]`, or that number in a one-element list (vLLM's per-item
/// shape), and `timestamps`: one finite number in `[0, MAX_SECOND_PER_GRID_T]` per
/// temporal patch (`t` of them). Nothing else. Embedding tensors (a base64 string) are
/// refused: the output must come through the connector.
fn embeds_meta(v: Option<&Value<'_>>, path: &Path<'_>, kind: MediaKind) -> Result<EmbedsMeta> {
    let (field, key, extras): (_, _, &[&str]) = match kind {
        MediaKind::Image => ("image_embeds", "image_grid_thw", &[]),
        MediaKind::Video => (
            "video_embeds",
            "video_grid_thw",
            &[SECOND_PER_GRID_TS, TIMESTAMPS],
        ),
    };
    let v = present(v).ok_or_else(|| missing(path))?;
    let members = match v {
        Value::Object(members) => members,
        Value::String(_) => {
            return Err(value_error(
                path,
                format!(
                    "embedding tensors are not accepted: '{field}' must be placeholder \
                     metadata ({{\"{key}\": [t, h, w]}}) for an encoder output that \
                     arrives through the EC connector"
                ),
            ))
        }
        other => return Err(type_error(path, "an object", other)),
    };
    if let Some((name, _)) = members
        .iter()
        .find(|(k, _)| k != key && !extras.contains(&k.as_ref()))
    {
        let expected = if extras.is_empty() {
            format!("only {key}")
        } else {
            format!("{key} and optionally {}", extras.join(", "))
        };
        return Err(value_error(
            path,
            format!(
                "unsupported {field} field '{}': expected {expected}",
                clip(name)
            ),
        ));
    }
    let grid_thw = embeds_grid(v, &path.key(key), key)?;
    let second_per_grid_ts = match kind {
        MediaKind::Video => present(v.get(SECOND_PER_GRID_TS))
            .map(|s| seconds_per_patch(s, &path.key(SECOND_PER_GRID_TS)))
            .transpose()?,
        MediaKind::Image => None,
    };
    let timestamps = match kind {
        MediaKind::Video => present(v.get(TIMESTAMPS))
            .map(|s| patch_times(s, &path.key(TIMESTAMPS), grid_thw[0]))
            .transpose()?,
        MediaKind::Image => None,
    };
    Ok(EmbedsMeta {
        grid_thw,
        second_per_grid_ts,
        timestamps,
    })
}

const SECOND_PER_GRID_TS: &str = "second_per_grid_ts";
const TIMESTAMPS: &str = "timestamps";

/// A video reference's `timestamps`: a list of `t` JSON numbers (the grid's temporal
/// patches), each finite and in `[0, MAX_SECOND_PER_GRID_T]`.
fn patch_times(v: &Value<'_>, path: &Path<'_>, t: u32) -> Result<Vec<f64>> {
    let values = array(v, path)?;
    if values.len() != t as usize {
        return Err(value_error(
            path,
            format!(
                "'{TIMESTAMPS}' must hold one time per temporal patch: {t} (the grid's t), got {}",
                values.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(values.len());
    for (i, value) in values.iter().enumerate() {
        let at = path.index(i);
        let seconds = match value {
            Value::Number(Number::Int(i)) => *i as f64,
            Value::Number(Number::UInt(u)) => *u as f64,
            Value::Number(Number::Float(f)) => *f,
            other => return Err(type_error(&at, "a number", other)),
        };
        if !(seconds.is_finite() && (0.0..=MAX_SECOND_PER_GRID_T).contains(&seconds)) {
            return Err(range_error(
                &at,
                format!("'{at}' must be in [0, {MAX_SECOND_PER_GRID_T}] seconds, got {seconds}"),
            ));
        }
        out.push(seconds);
    }
    Ok(out)
}

/// The grid under `key` of a reference's metadata `v`.
fn embeds_grid(v: &Value<'_>, gp: &Path<'_>, key: &str) -> Result<[u32; 3]> {
    let grid = present(v.get(key)).ok_or_else(|| missing(gp))?;
    let mut values = array(grid, gp)?;
    if let [inner @ Value::Array(_)] = values {
        values = array(inner, gp)?;
    }
    if values.len() != 3 {
        return Err(value_error(
            gp,
            format!("'{key}' must be three positive integers [t, h, w]"),
        ));
    }
    let mut out = [0u32; 3];
    for (i, value) in values.iter().enumerate() {
        out[i] = integer_in(value, &gp.index(i), 1, MAX_GRID_SIDE)? as u32;
    }
    Ok(out)
}

/// A video reference's `second_per_grid_ts`: a JSON number (not a string or a boolean),
/// bare or alone in a list, finite and in `(0, MAX_SECOND_PER_GRID_T]`.
fn seconds_per_patch(v: &Value<'_>, path: &Path<'_>) -> Result<f64> {
    let (value, at) = match v {
        Value::Array(items) if items.len() == 1 => (&items[0], path.index(0)),
        Value::Array(_) => {
            return Err(value_error(
                path,
                format!("'{SECOND_PER_GRID_TS}' must be one number (or a list of one)"),
            ))
        }
        other => (other, *path),
    };
    let seconds = match value {
        Value::Number(Number::Int(i)) => *i as f64,
        Value::Number(Number::UInt(u)) => *u as f64,
        Value::Number(Number::Float(f)) => *f,
        other => return Err(type_error(&at, "a number", other)),
    };
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= MAX_SECOND_PER_GRID_T) {
        return Err(range_error(
            &at,
            format!("'{at}' must be in (0, {MAX_SECOND_PER_GRID_T}] seconds, got {seconds}"),
        ));
    }
    Ok(seconds)
}

/// Responses `input` (a string, or a list of message items) with `instructions`
/// prepended as a system message.
pub fn responses_input(
    v: &Value<'_>,
    path: &Path<'_>,
    instructions: Option<&str>,
    limits: &Limits,
    media: &mut MediaCollector<'_>,
) -> Result<Vec<Message>> {
    let mut out = Vec::new();
    if let Some(text) = instructions {
        out.push(Message::new(
            Role::System,
            vec![Part::Text {
                text: text.to_owned(),
            }],
        ));
    }
    match v {
        Value::String(s) => {
            out.push(Message::new(
                Role::User,
                vec![Part::Text {
                    text: s.to_string(),
                }],
            ));
        }
        Value::Array(items) => {
            check_count(items.len(), limits, path)?;
            out.reserve(items.len());
            for (i, item) in items.iter().enumerate() {
                out.push(responses_item(item, &path.index(i), media)?);
            }
        }
        other => {
            return Err(type_error(
                path,
                "a string or an array of input items",
                other,
            ))
        }
    }
    Ok(out)
}

fn responses_item(
    item: &Value<'_>,
    path: &Path<'_>,
    media: &mut MediaCollector<'_>,
) -> Result<Message> {
    object(item, path)?;
    if let Some(t) = present(item.get("type")) {
        let tp = path.key("type");
        let t = string(t, &tp)?;
        if t != "message" {
            return Err(value_error(
                &tp,
                format!(
                    "unsupported input item type '{}': expected message",
                    clip(t)
                ),
            ));
        }
    }
    let role = role(item.get("role"), &path.key("role"))?;
    let cp = path.key("content");
    let content = match present(item.get("content")) {
        None => return Err(missing(&cp)),
        Some(v) => content_parts(v, &cp, media, responses_part)?,
    };
    Ok(Message::new(role, content))
}

fn responses_part(
    part: &Value<'_>,
    path: &Path<'_>,
    media: &mut MediaCollector<'_>,
) -> Result<Part> {
    object(part, path)?;
    let tp = path.key("type");
    let kind = string(present(part.get("type")).ok_or_else(|| missing(&tp))?, &tp)?;
    match kind {
        "input_text" | "output_text" => {
            let p = path.key("text");
            let text = string(present(part.get("text")).ok_or_else(|| missing(&p))?, &p)?;
            Ok(Part::Text {
                text: text.to_owned(),
            })
        }
        "input_image" => {
            let up = path.key("image_url");
            let url = string(
                present(part.get("image_url")).ok_or_else(|| missing(&up))?,
                &up,
            )?;
            let uuid = opt_uuid(part, path)?;
            let index =
                media.add_url_item(MediaKind::Image, url, uuid, &up, &up, &path.key("uuid"))?;
            Ok(Part::Image { media_index: index })
        }
        other => Err(value_error(
            &tp,
            format!(
                "unsupported content part type '{}': expected input_text or input_image",
                clip(other)
            ),
        )),
    }
}
