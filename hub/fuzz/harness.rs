//! What each fuzz target does with one input: plain functions over the
//! hub's public entry points, replayed by `tests/fuzz_regressions.rs`. A
//! harness panics only when an invariant breaks; refusing bad input with an
//! error is the expected outcome.

use std::sync::OnceLock;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use otter_hub::{
    manifest,
    methods::{MethodInfo, Methods},
    protocol::{
        connect::get_message,
        frames::{FLAG_COMPRESSED, Parser},
        general_proto_to_json,
        grpc_web::TextDecoder,
        gunzip, json_to_proto, proto_to_json,
    },
};

/// Limit small enough for the fuzzer to cross it with short inputs.
const SMALL: usize = 64;

/// Every RPC of the API, in a fixed order (the fuzzer picks by index).
fn methods() -> &'static [MethodInfo] {
    static ALL: OnceLock<Vec<MethodInfo>> = OnceLock::new();
    ALL.get_or_init(|| {
        let m = Methods::load(otter_proto::FILE_DESCRIPTOR_SET, &[]).expect("descriptor set");
        let mut paths: Vec<String> = m
            .pool
            .services()
            .flat_map(|s| {
                s.methods()
                    .map(|me| format!("/{}/{}", s.full_name(), me.name()))
                    .collect::<Vec<_>>()
            })
            .collect();
        paths.sort();
        paths.iter().filter_map(|p| m.get(p).cloned()).collect()
    })
}

/// Length-prefixed envelopes (Connect streaming, gRPC, gRPC-Web bodies):
/// the first byte picks the limit and how the rest is cut into reads. No
/// envelope over the limit comes out, the parser holds at most one
/// envelope's worth, and compressed payloads inflate to at most the limit.
pub fn connect_envelope(data: &[u8]) {
    let Some((&ctl, input)) = data.split_first() else {
        return;
    };
    let max = if ctl & 1 == 0 {
        SMALL
    } else {
        16 * 1024 * 1024
    };
    let step = usize::from(ctl >> 1).max(1);
    let mut parser = Parser::new(max);
    'feed: for piece in input.chunks(step) {
        parser.push(piece);
        loop {
            match parser.next_envelope() {
                Ok(Some(env)) => {
                    assert!(env.payload.len() <= max);
                    if env.flags & FLAG_COMPRESSED != 0
                        && let Ok(out) = gunzip(&env.payload, SMALL)
                    {
                        assert!(out.len() <= SMALL, "inflated past the limit");
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    assert!(e.len > e.max);
                    break 'feed;
                }
            }
        }
        assert!(parser.remaining() <= 5 + max + step);
    }
}

/// Connect's JSON requests (POST bodies) and GET queries. The first byte
/// picks the method (and, by its top bit, GET). JSON that is accepted must
/// encode to a message that encodes back to JSON and is accepted again.
pub fn connect_json(data: &[u8]) {
    let Some((&ctl, input)) = data.split_first() else {
        return;
    };
    let all = methods();
    let method = &all[usize::from(ctl & 0x7f) % all.len()];
    if ctl & 0x80 != 0 {
        let query = String::from_utf8_lossy(input);
        if let Ok(uri) = format!("/x?{query}").parse::<http::Uri>()
            && let Ok((bytes, json, _gzip)) = get_message(&uri)
            && json
        {
            json_round_trip(method, &bytes);
        }
        return;
    }
    json_round_trip(method, input);
}

fn json_round_trip(method: &MethodInfo, json: &[u8]) {
    if let Ok(proto) = json_to_proto(&method.input, json) {
        let back =
            proto_to_json(&method.input, &proto).expect("an accepted message prints as JSON");
        json_to_proto(&method.input, &back).expect("printed JSON is accepted again");
    }
}

/// Protobuf answers as an agent may send them, turned into JSON for a
/// browser: the first byte picks the method (and, by its top bit, its
/// request rather than its answer). Where the JSON written straight from
/// the wire answers, it is the general decoder's JSON; either way what
/// comes out is JSON, or both refuse.
pub fn proto_json(data: &[u8]) {
    let Some((&ctl, input)) = data.split_first() else {
        return;
    };
    let all = methods();
    let method = &all[usize::from(ctl & 0x7f) % all.len()];
    let desc = if ctl & 0x80 != 0 {
        &method.input
    } else {
        &method.output
    };
    let json = |out: Vec<u8>| -> serde_json::Value {
        serde_json::from_slice(&out)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out)))
    };
    match (
        proto_to_json(desc, input),
        general_proto_to_json(desc, input),
    ) {
        (Ok(fast), Ok(general)) => assert_eq!(json(fast), json(general), "{}", desc.full_name()),
        (Err(_), Err(_)) => {}
        (fast, general) => panic!(
            "{}: {:?} against the general path's {:?}",
            desc.full_name(),
            fast.map(String::from_utf8),
            general.map(String::from_utf8)
        ),
    }
}

/// `grpc-web-text` bodies: base64 in arbitrary chunks, then the envelopes
/// inside. Decoding never yields more than three bytes per four in.
pub fn grpc_web(data: &[u8]) {
    let Some((&ctl, input)) = data.split_first() else {
        return;
    };
    let step = usize::from(ctl).max(1);
    let mut decoder = TextDecoder::default();
    let mut parser = Parser::new(SMALL);
    let mut out = 0;
    for piece in input.chunks(step) {
        match decoder.push(piece) {
            Ok(Some(bytes)) => {
                out += bytes.len();
                parser.push(&bytes);
                while let Ok(Some(env)) = parser.next_envelope() {
                    assert!(env.payload.len() <= SMALL);
                }
            }
            Ok(None) => {}
            Err(_) => return,
        }
    }
    let _ = decoder.finish();
    assert!(
        out <= input.len() / 4 * 3,
        "{out} bytes out of {}",
        input.len()
    );
}

/// Manifest URL tokens. First byte 0: the rest is a token as it comes in a
/// URL path (nearly always a bad signature). Otherwise the rest is a claims
/// payload signed with the right key, which gets the fuzzer to the claims
/// parser: what verifies must be unexpired and for this CA, and the names
/// in it must make valid binding names.
pub fn manifest_url(data: &[u8]) {
    static KEY: OnceLock<ring::hmac::Key> = OnceLock::new();
    let key = KEY.get_or_init(|| ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"fuzz key"));
    const FP: &str = "fuzz-fingerprint";
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let token = if mode == 0 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        let payload = URL_SAFE_NO_PAD.encode(rest);
        let mac = URL_SAFE_NO_PAD.encode(ring::hmac::sign(key, payload.as_bytes()).as_ref());
        format!("{payload}.{mac}")
    };
    if let Ok(claims) = manifest::verify(key, &token, FP) {
        assert_eq!(claims.ca_fingerprint, FP);
        for user in &claims.admins {
            let name = manifest::admin_binding_name(user);
            assert!(name.len() <= 63, "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{name}"
            );
        }
        let _ = manifest::validate_users(&claims.admins);
    }
}
