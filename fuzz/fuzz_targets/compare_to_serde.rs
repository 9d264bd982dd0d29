//! The core's JSON reader against serde_json on the same bytes: both accept or both
//! reject, and what both accept reads as the same tree (members in order, duplicates
//! kept, numbers of the same kind and value). Where the two are meant to differ, the
//! difference is named: the core keeps integers beyond 64 bits as digits (serde_json
//! rounds them to floats, and rejects those beyond the float range), and limits an
//! integer to 4300 digits.

#![no_main]

use std::fmt;

use ec_core::{Limits, Number, RequestError, Value};
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// serde_json's reading of a document, members in order and duplicates kept.
#[derive(Debug, PartialEq)]
enum Tree {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(String),
    Arr(Vec<Tree>),
    Obj(Vec<(String, Tree)>),
}

struct TreeVisitor;

impl<'de> Visitor<'de> for TreeVisitor {
    type Value = Tree;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Tree, E> {
        Ok(Tree::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Tree, E> {
        Ok(Tree::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Tree, E> {
        Ok(Tree::U64(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Tree, E> {
        Ok(Tree::I64(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Tree, E> {
        Ok(Tree::F64(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Tree, E> {
        Ok(Tree::Str(v.to_owned()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Tree, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Tree::Arr(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Tree, A::Error> {
        let mut members = Vec::new();
        while let Some(member) = map.next_entry::<String, Tree>()? {
            members.push(member);
        }
        Ok(Tree::Obj(members))
    }
}

impl<'de> Deserialize<'de> for Tree {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Tree, D::Error> {
        d.deserialize_any(TreeVisitor)
    }
}

/// Whether the core's value reads as serde_json's tree.
fn same(ours: &Value<'_>, theirs: &Tree) -> bool {
    match (ours, theirs) {
        (Value::Null, Tree::Null) => true,
        (Value::Bool(a), Tree::Bool(b)) => a == b,
        (Value::Number(Number::Int(a)), Tree::U64(b)) => u64::try_from(*a) == Ok(*b),
        (Value::Number(Number::Int(a)), Tree::I64(b)) => *a < 0 && a == b,
        // serde_json reads `-0` as the float -0.0; the core as the integer 0.
        (Value::Number(Number::Int(0)), Tree::F64(b)) => *b == 0.0 && b.is_sign_negative(),
        (Value::Number(Number::UInt(a)), Tree::U64(b)) => a == b,
        (Value::Number(Number::Float(a)), Tree::F64(b)) => a.to_bits() == b.to_bits(),
        (Value::BigInt(digits), Tree::F64(b)) => digits.parse::<f64>().ok() == Some(*b),
        (Value::String(a), Tree::Str(b)) => a == b,
        (Value::Array(a), Tree::Arr(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same(x, y))
        }
        (Value::Object(a), Tree::Obj(b)) => {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((ka, va), (kb, vb))| ka == kb && same(va, vb))
        }
        _ => false,
    }
}

/// Whether the value holds an integer beyond the float range.
fn has_huge_integer(v: &Value<'_>) -> bool {
    match v {
        Value::BigInt(digits) => digits.parse::<f64>().map_or(true, f64::is_infinite),
        Value::Array(items) => items.iter().any(has_huge_integer),
        Value::Object(members) => members.iter().any(|(_, v)| has_huge_integer(v)),
        _ => false,
    }
}

const LIMITS: Limits = Limits {
    max_body_bytes: usize::MAX,
    max_depth: usize::MAX,
    max_messages: usize::MAX,
    max_media_items: usize::MAX,
    max_string_bytes: usize::MAX,
    max_media_bytes: usize::MAX,
    max_token_ids: usize::MAX,
};

fuzz_target!(|input: &[u8]| {
    let ours = ec_core::parse_body(input, &LIMITS);
    let theirs = serde_json::from_slice::<Tree>(input);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert!(same(a, b), "{a:?}\n{b:?}"),
        (Err(_), Err(_)) => {}
        (Ok(a), Err(e)) => assert!(
            e.to_string().starts_with("number out of range") && has_huge_integer(a),
            "accepted by the core only: {e}\n{a:?}"
        ),
        (Err(RequestError::LimitExceeded { message, .. }), Ok(_)) => {
            assert!(message.starts_with("an integer of"), "{message}")
        }
        (Err(e), Ok(b)) => panic!("accepted by serde_json only: {e}\n{b:?}"),
    }
});
