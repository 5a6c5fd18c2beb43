//! Protobuf to JSON (the canonical proto3 mapping) read straight off the
//! wire, for the shapes encoders write: each field once and in one run, a
//! map's keys once, no groups, no `Any`.
//!
//! A browser dashboard reads everything in JSON, and building a
//! `DynamicMessage` first (a tree of boxed values in ordered maps) made a
//! listing of 2,000 links cost 31–39 ms of CPU in JSON against 7–9 in
//! protobuf. Anything else (a field twice, a repeated field in two runs,
//! two members of a oneof, a value out of the mapping's range, bytes that
//! do not decode) returns [`Unusual`], and the caller goes the
//! `DynamicMessage` way, which gives the same JSON or the error: this
//! writer only ever answers where the two agree.

use base64::Engine;
use prost::Message;
use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};

/// Why the writer gave no JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The bytes are not in a shape this writer answers for.
    Unusual,
    /// The JSON would be longer than the limit given.
    TooLarge,
}

pub use Stop::{TooLarge, Unusual};

type W<T = ()> = Result<T, Stop>;

/// The JSON being written, and how long it may grow. A peer's few bytes
/// can make many of JSON (a control character six, an empty list element
/// five), so the length is checked as each field, element and long string
/// is written: the JSON stops at the limit rather than after it.
struct Out {
    buf: Vec<u8>,
    max: usize,
}

impl Out {
    /// [`TooLarge`] once the JSON is over the limit.
    fn room(&self) -> W {
        if self.buf.len() > self.max {
            return Err(TooLarge);
        }
        Ok(())
    }

    /// [`TooLarge`] if `more` bytes would take the JSON over the limit.
    fn room_for(&self, more: usize) -> W {
        if self.buf.len().saturating_add(more) > self.max {
            return Err(TooLarge);
        }
        Ok(())
    }
}

impl std::ops::Deref for Out {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl std::ops::DerefMut for Out {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

/// Nesting deeper than this is left to the general path (which has its own
/// limit and error).
const MAX_DEPTH: u32 = 64;

/// Up to this many keys, a map whose keys are not in increasing order (a
/// hash map's) has each new key compared with those before it; a larger
/// one has its keys sorted once, when it ends, to find one twice. Either
/// way a peer's map costs a bounded number of comparisons per key.
const LINEAR_KEYS: usize = 32;

/// `bytes`, a `desc`, as JSON of at most `max` bytes.
pub fn write(desc: &MessageDescriptor, bytes: &[u8], max: usize) -> W<Vec<u8>> {
    let mut out = Out {
        buf: Vec::with_capacity((bytes.len() * 2 + 16).min(max)),
        max,
    };
    message(&mut out, desc, bytes, 0)?;
    out.room()?;
    Ok(out.buf)
}

const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const I32: u8 = 5;

fn varint(b: &mut &[u8]) -> W<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&byte, rest) = b.split_first().ok_or(Unusual)?;
        *b = rest;
        // The tenth byte holds the 64th bit and nothing above it.
        if i == 9 && byte > 1 {
            return Err(Unusual);
        }
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Ok(v);
        }
    }
    Err(Unusual)
}

fn fixed<const N: usize>(b: &mut &[u8]) -> W<[u8; N]> {
    let (head, rest) = b.split_first_chunk::<N>().ok_or(Unusual)?;
    *b = rest;
    Ok(*head)
}

fn delimited<'a>(b: &mut &'a [u8]) -> W<&'a [u8]> {
    let len = usize::try_from(varint(b)?).map_err(|_| Unusual)?;
    if len > b.len() {
        return Err(Unusual);
    }
    let (head, rest) = b.split_at(len);
    *b = rest;
    Ok(head)
}

/// The next field's number and wire type.
fn key(b: &mut &[u8]) -> W<(u32, u8)> {
    // A key is 32 bits at most: the field number is its top 29.
    let k = u32::try_from(varint(b)?).map_err(|_| Unusual)?;
    let number = k >> 3;
    if number == 0 {
        return Err(Unusual);
    }
    Ok((number, (k & 7) as u8))
}

fn skip(b: &mut &[u8], wire: u8) -> W {
    match wire {
        VARINT => varint(b).map(drop),
        I64 => fixed::<8>(b).map(drop),
        LEN => delimited(b).map(drop),
        I32 => fixed::<4>(b).map(drop),
        _ => Err(Unusual),
    }
}

/// Strings from this length on have their JSON length counted before they
/// are written (a pass over the bytes), so that one string cannot take the
/// JSON far past its limit; shorter ones are checked after.
const COUNTED_STRING: usize = 4096;

fn string(out: &mut Out, s: &str) -> W {
    if s.len() >= COUNTED_STRING {
        out.room_for(escaped_len(s))?;
    }
    // Writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut **out, s);
    Ok(())
}

/// The length of `s` as a JSON string, as serde_json writes it: quotes,
/// two bytes for a quote, a backslash and the five control characters
/// with a short escape, six for the other control characters.
fn escaped_len(s: &str) -> usize {
    s.bytes().fold(2, |n, b| {
        n + match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..0x20 => 6,
            _ => 1,
        }
    })
}

/// One decoded scalar or enum, before it is written.
#[derive(Clone, Copy)]
enum Scalar<'a> {
    F64(f64),
    F32(f32),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    Bool(bool),
    Str(&'a str),
    Bytes(&'a [u8]),
    Enum(i32),
}

impl Scalar<'_> {
    fn is_default(self) -> bool {
        match self {
            Self::F64(v) => v == 0.0,
            Self::F32(v) => v == 0.0,
            Self::I32(v) | Self::Enum(v) => v == 0,
            Self::U32(v) => v == 0,
            Self::I64(v) => v == 0,
            Self::U64(v) => v == 0,
            Self::Bool(v) => !v,
            Self::Str(v) => v.is_empty(),
            Self::Bytes(v) => v.is_empty(),
        }
    }
}

/// Whether a kind's repeated values may come packed.
fn packable(kind: &Kind) -> bool {
    !matches!(kind, Kind::String | Kind::Bytes | Kind::Message(_))
}

/// Reads one scalar of `kind` sent with `wire`.
fn scalar<'a>(b: &mut &'a [u8], kind: &Kind, wire: u8) -> W<Scalar<'a>> {
    let v = match (kind, wire) {
        (Kind::Double, I64) => Scalar::F64(f64::from_le_bytes(fixed(b)?)),
        (Kind::Float, I32) => Scalar::F32(f32::from_le_bytes(fixed(b)?)),
        (Kind::Fixed64, I64) => Scalar::U64(u64::from_le_bytes(fixed(b)?)),
        (Kind::Sfixed64, I64) => Scalar::I64(i64::from_le_bytes(fixed(b)?)),
        (Kind::Fixed32, I32) => Scalar::U32(u32::from_le_bytes(fixed(b)?)),
        (Kind::Sfixed32, I32) => Scalar::I32(i32::from_le_bytes(fixed(b)?)),
        // Truncation is the wire format's: a 32-bit value is the low bits.
        (Kind::Int32, VARINT) => Scalar::I32(varint(b)? as i32),
        (Kind::Int64, VARINT) => Scalar::I64(varint(b)? as i64),
        (Kind::Uint32, VARINT) => Scalar::U32(varint(b)? as u32),
        (Kind::Uint64, VARINT) => Scalar::U64(varint(b)?),
        (Kind::Sint32, VARINT) => {
            let v = varint(b)? as u32;
            Scalar::I32((v >> 1) as i32 ^ -((v & 1) as i32))
        }
        (Kind::Sint64, VARINT) => {
            let v = varint(b)?;
            Scalar::I64((v >> 1) as i64 ^ -((v & 1) as i64))
        }
        (Kind::Bool, VARINT) => Scalar::Bool(varint(b)? != 0),
        (Kind::Enum(_), VARINT) => Scalar::Enum(varint(b)? as i32),
        (Kind::String, LEN) => {
            Scalar::Str(std::str::from_utf8(delimited(b)?).map_err(|_| Unusual)?)
        }
        (Kind::Bytes, LEN) => Scalar::Bytes(delimited(b)?),
        _ => return Err(Unusual),
    };
    Ok(v)
}

fn float(out: &mut Out, finite: bool, v: f64, write: impl FnOnce(&mut Vec<u8>)) {
    if finite {
        write(out);
    } else if v.is_nan() {
        out.extend_from_slice(b"\"NaN\"");
    } else if v > 0.0 {
        out.extend_from_slice(b"\"Infinity\"");
    } else {
        out.extend_from_slice(b"\"-Infinity\"");
    }
}

fn write_scalar(out: &mut Out, v: Scalar<'_>, kind: &Kind) -> W {
    use std::io::Write;
    // Writing to a Vec cannot fail.
    let _ = match v {
        Scalar::F64(v) => {
            float(out, v.is_finite(), v, |o| {
                let _ = serde_json::to_writer(o, &v);
            });
            Ok(())
        }
        Scalar::F32(v) => {
            float(out, v.is_finite(), f64::from(v), |o| {
                let _ = serde_json::to_writer(o, &v);
            });
            Ok(())
        }
        Scalar::I32(v) => write!(out, "{v}"),
        Scalar::U32(v) => write!(out, "{v}"),
        Scalar::I64(v) => write!(out, "\"{v}\""),
        Scalar::U64(v) => write!(out, "\"{v}\""),
        Scalar::Bool(v) => out.write_all(if v { b"true" } else { b"false" }),
        Scalar::Str(s) => return string(out, s),
        Scalar::Bytes(b) => {
            let len = base64::encoded_len(b.len(), true).unwrap_or(usize::MAX);
            out.room_for(len)?;
            out.push(b'"');
            let start = out.len();
            out.resize(start + len, 0);
            let _ = base64::engine::general_purpose::STANDARD.encode_slice(b, &mut out[start..]);
            out.push(b'"');
            Ok(())
        }
        Scalar::Enum(n) => match kind {
            Kind::Enum(e) if e.full_name() == "google.protobuf.NullValue" => out.write_all(b"null"),
            Kind::Enum(e) => match e.get_value(n) {
                Some(value) => return string(out, value.name()),
                None => write!(out, "{n}"),
            },
            _ => write!(out, "{n}"),
        },
    };
    Ok(())
}

/// A value of `kind` (not a list, not a map) sent with `wire`.
fn value(out: &mut Out, b: &mut &[u8], kind: &Kind, wire: u8, depth: u32) -> W {
    match kind {
        Kind::Message(m) => {
            if wire != LEN {
                return Err(Unusual);
            }
            message(out, m, delimited(b)?, depth + 1)
        }
        _ => {
            let v = scalar(b, kind, wire)?;
            write_scalar(out, v, kind)
        }
    }
}

/// Where a message's JSON object stands while its fields are written.
struct Object {
    first: bool,
    /// The fields written so far: numbers below 128 as bits (a message's
    /// usual fields, without allocating), the others listed.
    seen: u128,
    seen_high: Vec<u32>,
    /// The oneofs with a member written, each known by its first field's
    /// number.
    oneofs: Vec<u32>,
    /// The list or map whose run of entries is open: its number and the
    /// closing byte.
    open: Option<(u32, u8)>,
    /// The open map's keys.
    keys: Keys,
}

impl Object {
    fn new() -> Self {
        Self {
            first: true,
            seen: 0,
            seen_high: Vec::new(),
            oneofs: Vec::new(),
            open: None,
            keys: Keys::default(),
        }
    }

    fn key(&mut self, out: &mut Out, name: &str) -> W {
        if !self.first {
            out.push(b',');
        }
        self.first = false;
        string(out, name)?;
        out.push(b':');
        Ok(())
    }

    fn close(&mut self, out: &mut Out) -> W {
        if let Some((_, end)) = self.open.take() {
            out.push(end);
        }
        self.keys.finish(out)
    }

    /// A field's first appearance: once per message, once per oneof.
    fn first_of(&mut self, field: &FieldDescriptor) -> W {
        let number = field.number();
        match 1u128.checked_shl(number) {
            Some(bit) if self.seen & bit != 0 => return Err(Unusual),
            Some(bit) => self.seen |= bit,
            None if self.seen_high.contains(&number) => return Err(Unusual),
            None => self.seen_high.push(number),
        }
        if let Some(oneof) = field.containing_oneof() {
            let id = oneof.fields().next().map_or(number, |f| f.number());
            if self.oneofs.contains(&id) {
                return Err(Unusual);
            }
            self.oneofs.push(id);
        }
        Ok(())
    }
}

fn message(out: &mut Out, desc: &MessageDescriptor, mut b: &[u8], depth: u32) -> W {
    if depth > MAX_DEPTH {
        return Err(Unusual);
    }
    if desc.full_name().starts_with("google.protobuf.")
        && let Some(done) = well_known(out, desc.full_name(), b, depth)
    {
        return done;
    }
    out.push(b'{');
    let mut obj = Object::new();
    while !b.is_empty() {
        out.room()?;
        let (number, wire) = key(&mut b)?;
        let Some(field) = desc.get_field(number) else {
            // The general path writes an extension it knows.
            if desc.get_extension(number).is_some() {
                return Err(Unusual);
            }
            skip(&mut b, wire)?;
            continue;
        };
        let continuing = obj.open.is_some_and(|(n, _)| n == number);
        if !continuing {
            obj.close(out)?;
            obj.first_of(&field)?;
        }
        if field.is_map() {
            let Kind::Message(entry) = field.kind() else {
                return Err(Unusual);
            };
            if wire != LEN {
                return Err(Unusual);
            }
            if !continuing {
                obj.key(out, field.json_name())?;
                out.push(b'{');
                obj.open = Some((number, b'}'));
            }
            let first = obj.keys.spans.is_empty();
            map_entry(out, &entry, delimited(&mut b)?, &mut obj.keys, first, depth)?;
        } else if field.is_list() {
            let kind = field.kind();
            let element = |out: &mut Out, obj: &mut Object, b: &mut &[u8], wire| {
                out.room()?;
                match obj.open {
                    Some(_) => out.push(b','),
                    None => {
                        obj.key(out, field.json_name())?;
                        out.push(b'[');
                        obj.open = Some((number, b']'));
                    }
                }
                value(out, b, &kind, wire, depth)
            };
            if wire == LEN && packable(&kind) {
                // Packed: an empty run writes nothing, as an empty list
                // is not written.
                let mut run = delimited(&mut b)?;
                let wire = match kind {
                    Kind::Double | Kind::Fixed64 | Kind::Sfixed64 => I64,
                    Kind::Float | Kind::Fixed32 | Kind::Sfixed32 => I32,
                    _ => VARINT,
                };
                while !run.is_empty() {
                    element(out, &mut obj, &mut run, wire)?;
                }
            } else {
                element(out, &mut obj, &mut b, wire)?;
            }
        } else {
            let kind = field.kind();
            if let Kind::Message(_) = kind {
                obj.key(out, field.json_name())?;
                value(out, &mut b, &kind, wire, depth)?;
            } else {
                let v = scalar(&mut b, &kind, wire)?;
                // Without presence a default value is not written.
                if field.supports_presence() || !v.is_default() {
                    obj.key(out, field.json_name())?;
                    write_scalar(out, v, &kind)?;
                }
            }
        }
    }
    obj.close(out)?;
    out.push(b'}');
    Ok(())
}

/// One entry of a map (`key = 1`, `value = 2`, either may be missing) as
/// `"key":value`, after a comma unless it is the map's first.
fn map_entry(
    out: &mut Out,
    entry: &MessageDescriptor,
    mut b: &[u8],
    keys: &mut Keys,
    first: bool,
    depth: u32,
) -> W {
    out.room()?;
    let (mut k, mut v) = (None, None);
    while !b.is_empty() {
        let start = b;
        let (number, wire) = key(&mut b)?;
        skip(&mut b, wire)?;
        let slot = match number {
            1 => &mut k,
            2 => &mut v,
            _ => continue,
        };
        if slot.is_some() {
            return Err(Unusual);
        }
        // The field's bytes, key included: read again below.
        let taken = start.len() - b.len();
        *slot = Some((wire, &start[..taken]));
    }
    if !first {
        out.push(b',');
    }
    // The key, always written as a JSON string.
    let key_field = entry.map_entry_key_field();
    let key_kind = key_field.kind();
    let begin = out.len();
    match k {
        Some((wire, mut raw)) => {
            key(&mut raw)?;
            let s = scalar(&mut raw, &key_kind, wire)?;
            match s {
                Scalar::Str(s) => string(out, s)?,
                Scalar::Bool(_)
                | Scalar::I32(_)
                | Scalar::U32(_)
                | Scalar::I64(_)
                | Scalar::U64(_) => {
                    out.push(b'"');
                    write_bare(out, s);
                    out.push(b'"');
                }
                _ => return Err(Unusual),
            }
        }
        None => match key_kind {
            Kind::String => out.extend_from_slice(b"\"\""),
            Kind::Bool => out.extend_from_slice(b"\"false\""),
            _ => out.extend_from_slice(b"\"0\""),
        },
    }
    let end = out.len();
    distinct(out, keys, (begin, end))?;
    out.push(b':');
    let value_field = entry.map_entry_value_field();
    let kind = value_field.kind();
    match v {
        Some((wire, mut raw)) => {
            key(&mut raw)?;
            value(out, &mut raw, &kind, wire, depth)
        }
        None => {
            // A missing value is its kind's default.
            match &kind {
                Kind::Message(m) => message(out, m, &[], depth + 1)?,
                Kind::Enum(e) => {
                    let zero = Scalar::Enum(e.default_value().number());
                    write_scalar(out, zero, &kind)?;
                }
                Kind::String => out.extend_from_slice(b"\"\""),
                Kind::Bytes => out.extend_from_slice(b"\"\""),
                Kind::Bool => out.extend_from_slice(b"false"),
                Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 | Kind::Uint64 | Kind::Fixed64 => {
                    out.extend_from_slice(b"\"0\"")
                }
                Kind::Double | Kind::Float => out.extend_from_slice(b"0.0"),
                _ => out.extend_from_slice(b"0"),
            }
            Ok(())
        }
    }
}

/// An integer or bool without quotes (a map key's text).
fn write_bare(out: &mut Out, v: Scalar<'_>) {
    use std::io::Write;
    let _ = match v {
        Scalar::Bool(v) => out.write_all(if v { b"true" } else { b"false" }),
        Scalar::I32(v) => write!(out, "{v}"),
        Scalar::U32(v) => write!(out, "{v}"),
        Scalar::I64(v) => write!(out, "{v}"),
        Scalar::U64(v) => write!(out, "{v}"),
        _ => Ok(()),
    };
}

/// Where a map's keys were written in the output, and whether they came
/// in increasing order so far (then a new key above the last is new).
#[derive(Default)]
struct Keys {
    spans: Vec<(usize, usize)>,
    unsorted: bool,
}

impl Keys {
    /// [`Unusual`] if a map of more than [`LINEAR_KEYS`] keys, out of
    /// order, had one twice; called when the map ends.
    fn finish(&mut self, out: &[u8]) -> W {
        if self.unsorted && self.spans.len() > LINEAR_KEYS {
            let text = |&(a, b): &(usize, usize)| &out[a..b];
            self.spans.sort_unstable_by(|x, y| text(x).cmp(text(y)));
            if self.spans.windows(2).any(|w| text(&w[0]) == text(&w[1])) {
                return Err(Unusual);
            }
        }
        *self = Self::default();
        Ok(())
    }
}

/// Records the key just written at `new`; [`Unusual`] if the map had it
/// already (the general path keeps the last value of a repeated key).
fn distinct(out: &[u8], keys: &mut Keys, new: (usize, usize)) -> W {
    let text = |(a, b): (usize, usize)| &out[a..b];
    if let Some(&last) = keys.spans.last()
        && text(new) <= text(last)
    {
        keys.unsorted = true;
    }
    if keys.unsorted
        // Not in increasing order (a hash map's): compare with each while
        // the map is small; past that, [`Keys::finish`] sorts them.
        && keys.spans.len() <= LINEAR_KEYS
        && keys.spans.iter().any(|&k| text(k) == text(new))
    {
        return Err(Unusual);
    }
    keys.spans.push(new);
    Ok(())
}

/// The well-known types with a JSON form of their own; `None` for those
/// written as plain messages.
fn well_known(out: &mut Out, name: &str, b: &[u8], depth: u32) -> Option<W> {
    Some(match name {
        "google.protobuf.Struct" => struct_value(out, b, depth),
        "google.protobuf.Value" => json_value(out, b, depth),
        "google.protobuf.ListValue" => list_value(out, b, depth),
        "google.protobuf.Timestamp" => timestamp(out, b),
        "google.protobuf.Duration" => duration(out, b),
        "google.protobuf.Empty" => empty(out, b),
        "google.protobuf.DoubleValue" => wrapper(out, b, &Kind::Double),
        "google.protobuf.FloatValue" => wrapper(out, b, &Kind::Float),
        "google.protobuf.Int64Value" => wrapper(out, b, &Kind::Int64),
        "google.protobuf.UInt64Value" => wrapper(out, b, &Kind::Uint64),
        "google.protobuf.Int32Value" => wrapper(out, b, &Kind::Int32),
        "google.protobuf.UInt32Value" => wrapper(out, b, &Kind::Uint32),
        "google.protobuf.BoolValue" => wrapper(out, b, &Kind::Bool),
        "google.protobuf.StringValue" => wrapper(out, b, &Kind::String),
        "google.protobuf.BytesValue" => wrapper(out, b, &Kind::Bytes),
        // Any needs the type registry, FieldMask a case rewrite.
        "google.protobuf.Any" | "google.protobuf.FieldMask" => Err(Unusual),
        _ => return None,
    })
}

/// `{}`, once the bytes are found to be fields of some message.
fn empty(out: &mut Out, mut b: &[u8]) -> W {
    while !b.is_empty() {
        let (_, wire) = key(&mut b)?;
        skip(&mut b, wire)?;
    }
    out.extend_from_slice(b"{}");
    Ok(())
}

/// A wrapper's value (field 1), its kind's default when missing.
fn wrapper(out: &mut Out, mut b: &[u8], kind: &Kind) -> W {
    let mut found = None;
    while !b.is_empty() {
        let (number, wire) = key(&mut b)?;
        if number != 1 {
            skip(&mut b, wire)?;
            continue;
        }
        if found.is_some() {
            return Err(Unusual);
        }
        found = Some(scalar(&mut b, kind, wire)?);
    }
    let v = match found {
        Some(v) => v,
        None => scalar(&mut default_of(kind), kind, wire_of(kind))?,
    };
    // The general path writes a non-finite wrapped float as null.
    if matches!(v, Scalar::F32(f) if !f.is_finite())
        || matches!(v, Scalar::F64(f) if !f.is_finite())
    {
        return Err(Unusual);
    }
    write_scalar(out, v, kind)
}

fn wire_of(kind: &Kind) -> u8 {
    match kind {
        Kind::Double => I64,
        Kind::Float => I32,
        Kind::String | Kind::Bytes => LEN,
        _ => VARINT,
    }
}

/// The encoding of a scalar kind's default value, without its key.
fn default_of(kind: &Kind) -> &'static [u8] {
    match kind {
        Kind::Double => &[0; 8],
        Kind::Float => &[0; 4],
        _ => &[0],
    }
}

/// Calls `each` with every field 1 of `b` (length-delimited, in one run:
/// the general decoder would merge two runs), skipping the others.
fn field_one_run(mut b: &[u8], mut each: impl FnMut(&[u8]) -> W) -> W {
    let (mut run_ended, mut last) = (false, 0);
    while !b.is_empty() {
        let (number, wire) = key(&mut b)?;
        if number != 1 {
            skip(&mut b, wire)?;
            run_ended |= last == 1;
            last = number;
            continue;
        }
        if wire != LEN || run_ended {
            return Err(Unusual);
        }
        last = 1;
        each(delimited(&mut b)?)?;
    }
    Ok(())
}

/// `google.protobuf.Struct`: `fields` (1) is a map of strings to values.
fn struct_value(out: &mut Out, b: &[u8], depth: u32) -> W {
    if depth > MAX_DEPTH {
        return Err(Unusual);
    }
    out.push(b'{');
    let mut keys = Keys::default();
    field_one_run(b, |mut entry| {
        out.room()?;
        let (mut k, mut v) = (None, None);
        while !entry.is_empty() {
            let (number, wire) = key(&mut entry)?;
            match (number, wire) {
                (1, LEN) if k.is_none() => {
                    k = Some(std::str::from_utf8(delimited(&mut entry)?).map_err(|_| Unusual)?)
                }
                (2, LEN) if v.is_none() => v = Some(delimited(&mut entry)?),
                (1 | 2, _) => return Err(Unusual),
                _ => skip(&mut entry, wire)?,
            }
        }
        if !keys.spans.is_empty() {
            out.push(b',');
        }
        let begin = out.len();
        string(out, k.unwrap_or(""))?;
        let end = out.len();
        distinct(out, &mut keys, (begin, end))?;
        out.push(b':');
        json_value(out, v.unwrap_or(&[]), depth + 1)
    })?;
    keys.finish(out)?;
    out.push(b'}');
    Ok(())
}

/// `google.protobuf.Value`: one of null (1), number (2), string (3), bool
/// (4), struct (5), list (6); none is null.
fn json_value(out: &mut Out, mut b: &[u8], depth: u32) -> W {
    if depth > MAX_DEPTH {
        return Err(Unusual);
    }
    let mut kind = None;
    while !b.is_empty() {
        let start = b;
        let (number, wire) = key(&mut b)?;
        skip(&mut b, wire)?;
        if !(1..=6).contains(&number) {
            continue;
        }
        if kind.is_some() {
            return Err(Unusual);
        }
        let taken = start.len() - b.len();
        kind = Some((number, wire, &start[..taken]));
    }
    let Some((number, wire, mut raw)) = kind else {
        out.extend_from_slice(b"null");
        return Ok(());
    };
    key(&mut raw)?;
    match (number, wire) {
        (1, VARINT) => out.extend_from_slice(b"null"),
        (2, I64) => {
            let v = f64::from_le_bytes(fixed(&mut raw)?);
            // The general path refuses a non-finite number here.
            if !v.is_finite() {
                return Err(Unusual);
            }
            let _ = serde_json::to_writer(&mut **out, &v);
        }
        (3, LEN) => string(
            out,
            std::str::from_utf8(delimited(&mut raw)?).map_err(|_| Unusual)?,
        )?,
        (4, VARINT) => out.extend_from_slice(if varint(&mut raw)? != 0 {
            b"true"
        } else {
            b"false"
        }),
        (5, LEN) => struct_value(out, delimited(&mut raw)?, depth + 1)?,
        (6, LEN) => list_value(out, delimited(&mut raw)?, depth + 1)?,
        _ => return Err(Unusual),
    }
    Ok(())
}

/// `google.protobuf.ListValue`: `values` (1), in one run.
fn list_value(out: &mut Out, b: &[u8], depth: u32) -> W {
    if depth > MAX_DEPTH {
        return Err(Unusual);
    }
    out.push(b'[');
    let mut n = 0usize;
    field_one_run(b, |value| {
        out.room()?;
        if n > 0 {
            out.push(b',');
        }
        n += 1;
        json_value(out, value, depth + 1)
    })?;
    out.push(b']');
    Ok(())
}

/// RFC 3339, as the general path writes it; out of range is its error.
fn timestamp(out: &mut Out, b: &[u8]) -> W {
    use std::io::Write;
    let t = prost_types::Timestamp::decode(b).map_err(|_| Unusual)?;
    if !(-62_135_596_800..=253_402_300_799).contains(&t.seconds)
        || !(0..1_000_000_000).contains(&t.nanos)
    {
        return Err(Unusual);
    }
    let _ = write!(out, "\"{t}\"");
    Ok(())
}

/// Seconds with a fraction and an `s`, as the general path writes it.
fn duration(out: &mut Out, b: &[u8]) -> W {
    use std::io::Write;
    let d = prost_types::Duration::decode(b).map_err(|_| Unusual)?;
    let same_sign = (d.seconds >= 0 && d.nanos >= 0) || (d.seconds <= 0 && d.nanos <= 0);
    if d.seconds.unsigned_abs() > 315_576_000_000
        || d.nanos.unsigned_abs() > 999_999_999
        || !same_sign
    {
        return Err(Unusual);
    }
    let _ = write!(out, "\"{d}\"");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use prost_reflect::{DescriptorPool, DynamicMessage, MapKey, Value};

    use super::*;

    fn pool() -> DescriptorPool {
        DescriptorPool::decode(otter_proto::FILE_DESCRIPTOR_SET).unwrap()
    }

    /// What the general path makes of `bytes`.
    fn general(desc: &MessageDescriptor, bytes: &[u8]) -> Option<serde_json::Value> {
        let json = super::super::general_proto_to_json(desc, bytes).ok()?;
        Some(serde_json::from_slice(&json).unwrap())
    }

    /// This writer's answer, which must be the general path's where given,
    /// and fit a limit of exactly its length but not one byte less.
    fn agrees(desc: &MessageDescriptor, bytes: &[u8]) -> bool {
        let Ok(fast) = write(desc, bytes, usize::MAX) else {
            return false;
        };
        assert_eq!(write(desc, bytes, fast.len()).as_ref(), Ok(&fast));
        assert_eq!(write(desc, bytes, fast.len() - 1), Err(TooLarge));
        let fast: serde_json::Value = serde_json::from_slice(&fast).unwrap_or_else(|e| {
            panic!(
                "{}: not JSON ({e}): {}",
                desc.full_name(),
                String::from_utf8_lossy(&fast)
            )
        });
        assert_eq!(
            Some(&fast),
            general(desc, bytes).as_ref(),
            "{}",
            desc.full_name()
        );
        true
    }

    /// A small deterministic generator (xorshift), so a failure repeats.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, in_ten: u64) -> bool {
            self.below(10) < in_ten
        }
        fn text(&mut self) -> String {
            let pool = [
                "",
                "a",
                "web-1",
                "ä\u{1F600}",
                "quote\"back\\slash",
                "line\nbreak\u{1}",
            ];
            pool[self.below(pool.len() as u64) as usize].repeat(1 + self.below(3) as usize)
        }
    }

    fn scalar_value(kind: &Kind, rng: &mut Rng) -> Value {
        let special = [0.0, -0.0, 1.5, -2.25e300, 1e-7, f64::NAN, f64::INFINITY];
        match kind {
            Kind::Double => Value::F64(special[rng.below(special.len() as u64) as usize]),
            Kind::Float => Value::F32(special[rng.below(special.len() as u64) as usize] as f32),
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
                Value::I32(rng.next() as i32 >> rng.below(32))
            }
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
                Value::I64(rng.next() as i64 >> rng.below(64))
            }
            Kind::Uint32 | Kind::Fixed32 => Value::U32(rng.next() as u32 >> rng.below(32)),
            Kind::Uint64 | Kind::Fixed64 => Value::U64(rng.next() >> rng.below(64)),
            Kind::Bool => Value::Bool(rng.chance(5)),
            Kind::String => Value::String(rng.text()),
            Kind::Bytes => Value::Bytes(rng.text().into_bytes().into()),
            Kind::Enum(e) => {
                let values: Vec<_> = e.values().collect();
                if rng.chance(1) {
                    Value::EnumNumber(77)
                } else {
                    Value::EnumNumber(values[rng.below(values.len() as u64) as usize].number())
                }
            }
            Kind::Message(m) => Value::Message(random(m, rng, 3)),
        }
    }

    fn json_value(rng: &mut Rng, depth: u32) -> prost_types::Value {
        use prost_types::value::Kind as V;
        let kind = match rng.below(if depth == 0 { 4 } else { 6 }) {
            0 => V::NullValue(0),
            1 => V::NumberValue([0.0, 3.0, -1.25, 1e21][rng.below(4) as usize]),
            2 => V::StringValue(rng.text()),
            3 => V::BoolValue(rng.chance(5)),
            4 => V::StructValue(json_struct(rng, depth - 1)),
            _ => V::ListValue(prost_types::ListValue {
                values: (0..rng.below(4))
                    .map(|_| json_value(rng, depth - 1))
                    .collect(),
            }),
        };
        prost_types::Value { kind: Some(kind) }
    }

    fn json_struct(rng: &mut Rng, depth: u32) -> prost_types::Struct {
        prost_types::Struct {
            fields: (0..rng.below(5))
                .map(|i| (format!("{}{i}", rng.text()), json_value(rng, depth)))
                .collect(),
        }
    }

    /// A message of `desc` with fields set at random, the well-known types
    /// in their valid ranges.
    fn random(desc: &MessageDescriptor, rng: &mut Rng, depth: u32) -> DynamicMessage {
        let wkt = |bytes: Vec<u8>| DynamicMessage::decode(desc.clone(), bytes.as_slice()).unwrap();
        match desc.full_name() {
            "google.protobuf.Struct" => return wkt(json_struct(rng, 2).encode_to_vec()),
            "google.protobuf.Value" => return wkt(json_value(rng, 2).encode_to_vec()),
            "google.protobuf.Timestamp" => {
                let t = prost_types::Timestamp {
                    seconds: (rng.below(4_000_000_000)) as i64,
                    nanos: [0, 500_000_000, 123_456_789, 1_000][rng.below(4) as usize],
                };
                return wkt(t.encode_to_vec());
            }
            "google.protobuf.Duration" => {
                let d = prost_types::Duration {
                    seconds: rng.below(100_000) as i64,
                    nanos: [0, 500_000_000, 1_000][rng.below(3) as usize],
                };
                return wkt(d.encode_to_vec());
            }
            _ => {}
        }
        let mut msg = DynamicMessage::new(desc.clone());
        for field in desc.fields() {
            if !rng.chance(6) {
                continue;
            }
            let kind = field.kind();
            if depth == 0 && matches!(kind, Kind::Message(_)) {
                continue;
            }
            let one = |rng: &mut Rng| match &kind {
                Kind::Message(m) => Value::Message(random(m, rng, depth - 1)),
                k => scalar_value(k, rng),
            };
            let v = if field.is_map() {
                let Kind::Message(entry) = &kind else {
                    unreachable!()
                };
                let (kf, vf) = (entry.map_entry_key_field(), entry.map_entry_value_field());
                let mut map = HashMap::new();
                for _ in 0..rng.below(4) {
                    let key = match scalar_value(&kf.kind(), rng) {
                        Value::String(s) => MapKey::String(s),
                        Value::I32(v) => MapKey::I32(v),
                        Value::I64(v) => MapKey::I64(v),
                        Value::U32(v) => MapKey::U32(v),
                        Value::U64(v) => MapKey::U64(v),
                        Value::Bool(v) => MapKey::Bool(v),
                        other => panic!("map key {other:?}"),
                    };
                    let value = match vf.kind() {
                        Kind::Message(m) if depth > 0 => Value::Message(random(&m, rng, depth - 1)),
                        Kind::Message(m) => Value::Message(DynamicMessage::new(m)),
                        k => scalar_value(&k, rng),
                    };
                    map.insert(key, value);
                }
                Value::Map(map)
            } else if field.is_list() {
                Value::List((0..rng.below(4)).map(|_| one(rng)).collect())
            } else {
                one(rng)
            };
            msg.set_field(&field, v);
        }
        msg
    }

    /// Every message of the API, at random many times over: where this
    /// writer answers, its JSON is the general path's, and for the
    /// messages encoders write it answers nearly always.
    #[test]
    fn agrees_with_the_general_path_on_every_message_of_the_api() {
        let pool = pool();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut tried, mut answered) = (0, 0);
        for desc in pool.all_messages() {
            for _ in 0..40 {
                let msg = random(&desc, &mut rng, 3);
                let bytes = msg.encode_to_vec();
                tried += 1;
                if agrees(&desc, &bytes) {
                    answered += 1;
                }
            }
        }
        // What it leaves to the general path: Any, FieldMask, wrapped
        // non-finite floats.
        assert!(answered * 10 > tried * 9, "answered {answered} of {tried}");
    }

    /// The answers a browser reads most, whole.
    #[test]
    fn answers_listings_and_objects() {
        let pool = pool();
        let mut rng = Rng(7);
        for name in [
            "otterscale.link.v1.ListLinksResponse",
            "otterscale.resource.v1.ListResponse",
            "otterscale.resource.v1.WatchEvent",
            "otterscale.resource.v1.Resource",
        ] {
            let desc = pool
                .get_message_by_name(name)
                .unwrap_or_else(|| panic!("{name}"));
            for _ in 0..50 {
                let bytes = random(&desc, &mut rng, 4).encode_to_vec();
                assert!(agrees(&desc, &bytes), "{name}: left to the general path");
            }
        }
    }

    /// Shapes encoders do not write are left to the general path, which
    /// decides (last value wins, lists merge, or an error).
    #[test]
    fn leaves_unusual_shapes_to_the_general_path() {
        let pool = pool();
        let resource = pool
            .get_message_by_name("otterscale.resource.v1.GetRequest")
            .unwrap();
        let s = pool.get_message_by_name("google.protobuf.Struct").unwrap();
        let field = |n: u8, s: &[u8]| [&[n << 3 | 2, s.len() as u8][..], s].concat();
        let entry = |k: &str| field(1, &[field(1, k.as_bytes()), field(2, &[])].concat());
        let cases: Vec<(&MessageDescriptor, Vec<u8>)> = vec![
            // The same field twice.
            (&resource, [field(1, b"a"), field(1, b"b")].concat()),
            // Not UTF-8.
            (&resource, field(1, &[0xff, 0xfe])),
            // Cut short.
            (&resource, vec![10, 5, b'a']),
            // A group.
            (&resource, vec![11, 12]),
            // A map key twice.
            (&s, [entry("k"), entry("k")].concat()),
            (&s, [entry("b"), entry("a"), entry("b")].concat()),
        ];
        for (desc, bytes) in cases {
            assert_eq!(write(desc, &bytes, usize::MAX), Err(Unusual), "{bytes:?}");
            // The public function still answers as the general path does.
            let public = super::super::proto_to_json(desc, &bytes).ok();
            let general = super::super::general_proto_to_json(desc, &bytes).ok();
            assert_eq!(public, general);
        }
        // Keys out of order but distinct are fine.
        let bytes = [entry("b"), entry("a"), entry("c")].concat();
        assert!(agrees(&s, &bytes));
    }

    /// A map in a hash map's order keeps the writer, however many keys it
    /// has (a cluster's labels, an object's fields); one key twice, past
    /// the keys compared one by one, is still found.
    #[test]
    fn large_maps_in_any_order_are_answered_once_each_key() {
        let pool = pool();
        let object = pool.get_message_by_name("google.protobuf.Struct").unwrap();
        let link = pool.get_message_by_name("otterscale.link.v1.Link").unwrap();
        let labels = link.get_field_by_name("labels").unwrap().number();
        let field = |n: u32, body: &[u8]| {
            let mut out = Vec::new();
            prost::encoding::encode_key(n, prost::encoding::WireType::LengthDelimited, &mut out);
            prost::encoding::encode_varint(body.len() as u64, &mut out);
            out.extend_from_slice(body);
            out
        };
        let mut rng = Rng(7);
        let mut keys: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
        // Shuffled, as a hash map iterates.
        for i in (1..keys.len()).rev() {
            keys.swap(i, rng.below(i as u64 + 1) as usize);
        }
        // A Struct's values are `Value`s (here the string "v"), a label's
        // plain strings.
        let text = field(3, b"v");
        let entry = |k: &str| field(1, &[field(1, k.as_bytes()), field(2, &text)].concat());
        let label = |k: &str| field(labels, &[field(1, k.as_bytes()), field(2, b"v")].concat());
        let fields: Vec<u8> = keys.iter().flat_map(|k| entry(k)).collect();
        let labelled: Vec<u8> = keys.iter().flat_map(|k| label(k)).collect();
        assert!(agrees(&object, &fields));
        assert!(agrees(&link, &labelled));
        // The 200th key again, at the end.
        let twice = [fields, entry(&keys[200])].concat();
        assert_eq!(write(&object, &twice, usize::MAX), Err(Unusual));
        let twice = [labelled, label(&keys[200])].concat();
        assert_eq!(write(&link, &twice, usize::MAX), Err(Unusual));
    }

    /// A long string's JSON length is counted as serde_json writes it.
    #[test]
    fn escaped_length_is_the_written_length() {
        let all: String = (0u32..0x300).filter_map(char::from_u32).collect();
        for s in [
            all.as_str(),
            "",
            "plain",
            "\"\\\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}é😀",
        ] {
            assert_eq!(
                escaped_len(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
    }

    /// JSON stops at the limit: a string whose escapes would pass it is not
    /// written, nor the elements of a list past it.
    #[test]
    fn stops_at_the_limit() {
        let pool = pool();
        let value = pool.get_message_by_name("google.protobuf.Value").unwrap();
        let encoded = |kind| prost_types::Value { kind: Some(kind) }.encode_to_vec();
        use prost_types::value::Kind as V;
        let controls = encoded(V::StringValue("\u{1}".repeat(10_000)));
        let json = write(&value, &controls, 60_002).unwrap();
        assert_eq!(json.len(), 60_002);
        assert_eq!(&json[..7], b"\"\\u0001");
        assert_eq!(write(&value, &controls, 60_001), Err(TooLarge));
        assert_eq!(write(&value, &controls, 20_000), Err(TooLarge));
        let empty = prost_types::Value { kind: None };
        let nulls = encoded(V::ListValue(prost_types::ListValue {
            values: vec![empty; 100_000],
        }));
        assert_eq!(write(&value, &nulls, 500_001).map(|j| j.len()), Ok(500_001));
        assert_eq!(write(&value, &nulls, 1_000), Err(TooLarge));
    }
}
