//! Body bytes -> [`Value`], with every failure mapped to a typed [`RequestError`].
//!
//! A small recursive-descent parser over the UTF-8-checked text. It borrows every
//! string without escapes (and every number's digits) from the body, keeps integers
//! beyond 64 bits exact, enforces the depth limit before it descends (a 10,000-deep
//! body stops at [`Limits::effective_depth`], far from any stack limit) and the string
//! limit as it goes, and names `NaN` / `Infinity` when it meets them.
//!
//! It replaces `serde_json` here for speed and exactness: building serde_json's tree
//! took about twice as long, and serde_json either rounds integers beyond 64 bits to
//! floats or (with `arbitrary_precision`) allocates a string for every number.

use std::borrow::Cow;

use crate::error::{RequestError, Result};
use crate::limits::Limits;
use crate::value::{Number, Value};

/// Parses a whole body. The result borrows escape-free strings from `body`.
pub fn parse_body<'a>(body: &'a [u8], limits: &Limits) -> Result<Value<'a>> {
    if body.len() > limits.max_body_bytes {
        return Err(RequestError::LimitExceeded {
            param: None,
            message: format!(
                "request body is {} bytes, over the limit of {} bytes",
                body.len(),
                limits.max_body_bytes
            ),
        });
    }
    let text = std::str::from_utf8(body).map_err(|e| RequestError::InvalidUtf8 {
        offset: e.valid_up_to(),
    })?;
    parse_str(text, limits)
}

/// Parses a JSON text (already known to be UTF-8).
pub fn parse_str<'a>(text: &'a str, limits: &Limits) -> Result<Value<'a>> {
    let mut p = Parser {
        text,
        bytes: text.as_bytes(),
        pos: 0,
        max_depth: limits.effective_depth(),
        max_string_bytes: limits.max_string_bytes,
        items: Vec::with_capacity(64),
        members: Vec::with_capacity(64),
    };
    p.skip_ws();
    if p.pos == p.bytes.len() {
        return Err(RequestError::InvalidJson {
            message: "request body is empty: expected a JSON object".into(),
        });
    }
    let root = p.value(0).map_err(|e| *e)?;
    p.skip_ws();
    if p.pos != p.bytes.len() {
        return Err(*p.syntax("trailing characters after the JSON value"));
    }
    Ok(root)
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    max_depth: usize,
    max_string_bytes: usize,
    /// The elements of the arrays and the members of the objects being parsed, as
    /// stacks: a container moves its own tail into an exactly sized `Vec` (one copy)
    /// when it closes.
    items: Vec<Value<'a>>,
    members: Vec<(Cow<'a, str>, Value<'a>)>,
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `w` (little-endian) that is `"`, `\` or below 0x20,
/// with one caveat: a byte above a flagged one may be flagged too (a borrow runs
/// upwards), so only the lowest flag is exact, which is all a scan needs.
#[inline]
fn special_bytes(w: u64) -> u64 {
    let quote = w ^ (ONES * u64::from(b'"'));
    let backslash = w ^ (ONES * u64::from(b'\\'));
    let zero_in = |x: u64| x.wrapping_sub(ONES) & !x;
    (zero_in(quote) | zero_in(backslash) | (w.wrapping_sub(ONES * 0x20) & !w)) & HIGHS
}

/// Index of the next `"`, `\` or control byte of `b` at or after `i`.
#[inline]
fn find_special(b: &[u8], mut i: usize) -> Option<usize> {
    while let Some(chunk) = b.get(i..i + 8) {
        let Ok(word) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let mask = special_bytes(u64::from_le_bytes(word));
        if mask != 0 {
            // The lowest flagged byte is always a true one (see `special_bytes`).
            return Some(i + (mask.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    while i < b.len() {
        if is_special(b[i]) {
            return Some(i);
        }
        i += 1;
    }
    None
}

#[inline]
fn is_special(b: u8) -> bool {
    matches!(b, b'"' | b'\\' | 0..=0x1f)
}

impl<'a> Parser<'a> {
    fn line_column(&self) -> (usize, usize) {
        let upto = &self.bytes[..self.pos.min(self.bytes.len())];
        let line = upto.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = upto.len() - upto.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        (line, column)
    }

    fn syntax(&self, what: &str) -> Box<RequestError> {
        let (line, column) = self.line_column();
        let message = if self.pos >= self.bytes.len() {
            format!("invalid JSON: unexpected end of input (truncated body?) at line {line} column {column}")
        } else {
            format!("invalid JSON: {what} at line {line} column {column}")
        };
        Box::new(RequestError::InvalidJson { message })
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(&b) = self.bytes.get(self.pos) {
            if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                break;
            }
            self.pos += 1;
        }
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    /// Parses one value.
    fn value(&mut self, depth: usize) -> PResult<Value<'a>> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number_value(),
            Some(b'N' | b'I') => Err(self.nan_or_infinity()),
            _ => Err(self.syntax("expected a value")),
        }
    }

    fn nan_or_infinity(&self) -> Box<RequestError> {
        let (line, column) = self.line_column();
        Box::new(RequestError::InvalidJson {
            message: format!(
                "invalid JSON: NaN and Infinity are not JSON numbers (line {line} column {column})"
            ),
        })
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> PResult<Value<'a>> {
        if self.bytes[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.syntax("expected a value"))
        }
    }

    fn enter(&self, depth: usize) -> PResult<()> {
        if depth > self.max_depth {
            return Err(Box::new(RequestError::LimitExceeded {
                param: None,
                message: format!(
                    "request body nests deeper than the limit of {} levels",
                    self.max_depth
                ),
            }));
        }
        Ok(())
    }

    fn array(&mut self, depth: usize) -> PResult<Value<'a>> {
        self.enter(depth)?;
        self.pos += 1;
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(Vec::new()));
        }
        let mark = self.items.len();
        loop {
            self.skip_ws();
            let item = self.value(depth)?;
            self.items.push(item);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax("expected ',' or ']' in an array")),
            }
        }
        Ok(Value::Array(split_tail(&mut self.items, mark)))
    }

    fn object(&mut self, depth: usize) -> PResult<Value<'a>> {
        self.enter(depth)?;
        self.pos += 1;
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(Vec::new()));
        }
        let mark = self.members.len();
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.syntax("expected a string key in an object"));
            }
            let key = self.string()?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.syntax("expected ':' after an object key"));
            }
            self.pos += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            self.members.push((key, value));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax("expected ',' or '}' in an object")),
            }
        }
        Ok(Value::Object(split_tail(&mut self.members, mark)))
    }

    #[inline]
    fn find_special(&self, i: usize) -> Option<usize> {
        find_special(self.bytes, i)
    }

    fn check_len(&self, len: usize) -> PResult<()> {
        if len > self.max_string_bytes {
            return Err(Box::new(RequestError::LimitExceeded {
                param: None,
                message: format!(
                    "a string of {len} bytes is over the limit of {} bytes",
                    self.max_string_bytes
                ),
            }));
        }
        Ok(())
    }

    /// A string starting at the current `"`.
    fn string(&mut self) -> PResult<Cow<'a, str>> {
        let start = self.pos + 1;
        let Some(end) = self.find_special(start) else {
            self.pos = self.bytes.len();
            return Err(self.syntax("unterminated string"));
        };
        if self.bytes[end] == b'"' {
            self.check_len(end - start)?;
            self.pos = end + 1;
            // Both ends sit on ASCII bytes of a valid UTF-8 text.
            return Ok(Cow::Borrowed(&self.text[start..end]));
        }
        let mut out = String::with_capacity(end - start + 16);
        out.push_str(&self.text[start..end]);
        self.pos = end;
        loop {
            let Some(&b) = self.bytes.get(self.pos) else {
                return Err(self.syntax("unterminated string"));
            };
            match b {
                b'"' => {
                    self.pos += 1;
                    self.check_len(out.len())?;
                    return Ok(Cow::Owned(out));
                }
                b'\\' => self.escape(&mut out)?,
                0..=0x1f => return Err(self.syntax("control character in a string")),
                _ => {
                    let run_end = self.find_special(self.pos).unwrap_or(self.bytes.len());
                    out.push_str(&self.text[self.pos..run_end]);
                    self.pos = run_end;
                }
            }
            if out.len() > self.max_string_bytes {
                return self.check_len(out.len()).map(|()| Cow::Owned(out));
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> PResult<()> {
        self.pos += 1;
        let Some(&c) = self.bytes.get(self.pos) else {
            return Err(self.syntax("unterminated string"));
        };
        self.pos += 1;
        let ch = match c {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let first = self.hex4()?;
                match first {
                    0xD800..=0xDBFF => {
                        if !self.bytes[self.pos..].starts_with(b"\\u") {
                            return Err(self.syntax("lone leading surrogate in a \\u escape"));
                        }
                        self.pos += 2;
                        let second = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&second) {
                            return Err(self.syntax("invalid surrogate pair in a \\u escape"));
                        }
                        let code = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
                        char::from_u32(code).ok_or_else(|| self.syntax("invalid \\u escape"))?
                    }
                    0xDC00..=0xDFFF => {
                        return Err(self.syntax("lone trailing surrogate in a \\u escape"))
                    }
                    code => {
                        char::from_u32(code).ok_or_else(|| self.syntax("invalid \\u escape"))?
                    }
                }
            }
            _ => {
                self.pos -= 1;
                return Err(self.syntax("invalid escape in a string"));
            }
        };
        out.push(ch);
        Ok(())
    }

    fn hex4(&mut self) -> PResult<u32> {
        let digits = self
            .bytes
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.syntax("unterminated \\u escape"))?;
        let mut code = 0u32;
        for &d in digits {
            let v = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return Err(self.syntax("invalid \\u escape")),
            };
            code = code * 16 + u32::from(v);
        }
        self.pos += 4;
        Ok(code)
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number_value(&mut self) -> PResult<Value<'a>> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
            if self.peek() == Some(b'I') {
                return Err(self.nan_or_infinity());
            }
        }
        let int_start = self.pos;
        match self.digits() {
            0 => return Err(self.syntax("invalid number")),
            n if n > 1 && self.bytes[int_start] == b'0' => {
                self.pos = int_start + 1;
                return Err(self.syntax("invalid number: leading zero"));
            }
            _ => {}
        }
        let int_end = self.pos;
        let mut is_float = false;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.syntax("invalid number"));
            }
            is_float = true;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.syntax("invalid number"));
            }
            is_float = true;
        }
        let literal = &self.text[start..self.pos];
        if is_float {
            return match literal.parse::<f64>() {
                Ok(f) if f.is_finite() => Ok(Value::Number(Number::Float(f))),
                _ => Err(self.syntax("number out of range")),
            };
        }
        let mut magnitude: u64 = 0;
        for &d in &self.bytes[int_start..int_end] {
            match magnitude
                .checked_mul(10)
                .and_then(|m| m.checked_add(u64::from(d - b'0')))
            {
                Some(m) => magnitude = m,
                None => return self.big_integer(literal, int_end - int_start),
            }
        }
        Ok(Value::Number(if negative {
            match magnitude {
                0 => Number::Int(0),
                m if m <= 1 << 63 => Number::Int((m as i64).wrapping_neg()),
                _ => return self.big_integer(literal, int_end - int_start),
            }
        } else {
            match i64::try_from(magnitude) {
                Ok(i) => Number::Int(i),
                Err(_) => Number::UInt(magnitude),
            }
        }))
    }

    fn big_integer(&self, literal: &'a str, digits: usize) -> PResult<Value<'a>> {
        if digits > MAX_BIG_INTEGER_DIGITS {
            return Err(Box::new(RequestError::LimitExceeded {
                param: None,
                message: format!(
                    "an integer of {digits} digits is over the limit of {MAX_BIG_INTEGER_DIGITS}"
                ),
            }));
        }
        Ok(Value::BigInt(Cow::Borrowed(literal)))
    }
}

/// The elements of `stack` from `mark` on, moved into an exactly sized `Vec` with one
/// copy. (`split_off(0)` would hand over the stack's whole buffer instead.)
fn split_tail<T>(stack: &mut Vec<T>, mark: usize) -> Vec<T> {
    if mark > 0 {
        return stack.split_off(mark);
    }
    let mut tail = Vec::with_capacity(stack.len());
    tail.append(stack);
    tail
}

/// Parser-internal results: the error boxed, so that the hot `Ok` path moves less.
type PResult<T> = std::result::Result<T, Box<RequestError>>;

/// Most digits of an integer beyond 64 bits (Python's default int-string limit).
const MAX_BIG_INTEGER_DIGITS: usize = 4300;

#[cfg(test)]
mod tests {
    use super::{find_special, is_special};

    /// The word scan against a byte-by-byte scan, for each kind of special byte at
    /// every offset of buffers of text, UTF-8 and near-miss bytes (0x20, 0x21, 0x5b,
    /// 0x5d, 0x7f, bytes of 0x80 and above), with another special byte after it.
    #[test]
    fn word_scan_finds_the_first_special_byte() {
        let filler = "ab c!#[]é😀\u{7f}".as_bytes();
        for special in [b'"', b'\\', 0x00, 0x0a, 0x1f] {
            for len in 0..40 {
                for at in 0..=len {
                    let mut buf: Vec<u8> = filler.iter().copied().cycle().take(len).collect();
                    if at < len {
                        buf[at] = special;
                        if at + 3 < len {
                            buf[at + 3] = 0x01;
                        }
                    }
                    for from in 0..=len.min(9) {
                        let want = buf[from..].iter().position(|&b| is_special(b));
                        let want = want.map(|p| p + from);
                        assert_eq!(find_special(&buf, from), want, "{buf:?} from {from}");
                    }
                }
            }
        }
    }
}
