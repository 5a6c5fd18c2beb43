//! Decoding of request bodies in the Kubernetes protobuf encoding, for the kinds kubectl's
//! typed clients send that way (`create namespace|configmap|secret|deployment|service|
//! serviceaccount`, `auth can-i`, `create token`). The body is the `k8s\0` magic and a
//! `runtime.Unknown` envelope whose `raw` field holds the object.
//!
//! The tables below list the fields those commands set, by field number. Fields not in a
//! table are skipped, so an unusual object may lose detail; responses are always JSON,
//! which every client accepts.

use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// How a field's value is encoded.
#[derive(Debug, Clone, Copy)]
enum K {
    Str,
    Int,
    Bool,
    Msg(&'static [Field]),
    MapStr,
    MapBytes,
    MapQuantity,
    Time,
    IntOrString,
}

#[derive(Debug)]
struct Field {
    num: u64,
    name: &'static str,
    kind: K,
    repeated: bool,
    /// Go encodes every non-pointer field, zero or not; only pointer fields (this flag)
    /// carry meaning when zero. Other zero values are dropped, as JSON's omitempty would.
    zero_matters: bool,
}

const fn f(num: u64, name: &'static str, kind: K) -> Field {
    Field {
        num,
        name,
        kind,
        repeated: false,
        zero_matters: false,
    }
}

const fn p(num: u64, name: &'static str, kind: K) -> Field {
    Field {
        num,
        name,
        kind,
        repeated: false,
        zero_matters: true,
    }
}

const fn r(num: u64, name: &'static str, kind: K) -> Field {
    Field {
        num,
        name,
        kind,
        repeated: true,
        zero_matters: false,
    }
}

static OWNER_REF: &[Field] = &[
    f(5, "apiVersion", K::Str),
    f(1, "kind", K::Str),
    f(3, "name", K::Str),
    f(4, "uid", K::Str),
    p(6, "controller", K::Bool),
    p(7, "blockOwnerDeletion", K::Bool),
];

static OBJECT_META: &[Field] = &[
    f(1, "name", K::Str),
    f(2, "generateName", K::Str),
    f(3, "namespace", K::Str),
    f(5, "uid", K::Str),
    f(6, "resourceVersion", K::Str),
    f(7, "generation", K::Int),
    f(8, "creationTimestamp", K::Time),
    f(11, "labels", K::MapStr),
    f(12, "annotations", K::MapStr),
    r(13, "ownerReferences", K::Msg(OWNER_REF)),
    r(14, "finalizers", K::Str),
];

static SELECTOR_REQ: &[Field] = &[
    f(1, "key", K::Str),
    f(2, "operator", K::Str),
    r(3, "values", K::Str),
];
static LABEL_SELECTOR: &[Field] = &[
    f(1, "matchLabels", K::MapStr),
    r(2, "matchExpressions", K::Msg(SELECTOR_REQ)),
];

static CONTAINER_PORT: &[Field] = &[
    f(1, "name", K::Str),
    f(2, "hostPort", K::Int),
    f(3, "containerPort", K::Int),
    f(4, "protocol", K::Str),
    f(5, "hostIP", K::Str),
];
static ENV_VAR: &[Field] = &[f(1, "name", K::Str), f(2, "value", K::Str)];
static RESOURCES: &[Field] = &[
    f(1, "limits", K::MapQuantity),
    f(2, "requests", K::MapQuantity),
];
static VOLUME_MOUNT: &[Field] = &[
    f(1, "name", K::Str),
    f(2, "readOnly", K::Bool),
    f(3, "mountPath", K::Str),
    f(4, "subPath", K::Str),
];
static CONTAINER: &[Field] = &[
    f(1, "name", K::Str),
    f(2, "image", K::Str),
    r(3, "command", K::Str),
    r(4, "args", K::Str),
    f(5, "workingDir", K::Str),
    r(6, "ports", K::Msg(CONTAINER_PORT)),
    r(7, "env", K::Msg(ENV_VAR)),
    f(8, "resources", K::Msg(RESOURCES)),
    r(9, "volumeMounts", K::Msg(VOLUME_MOUNT)),
    f(13, "terminationMessagePath", K::Str),
    f(14, "imagePullPolicy", K::Str),
    f(16, "stdin", K::Bool),
    f(17, "stdinOnce", K::Bool),
    f(18, "tty", K::Bool),
    f(20, "terminationMessagePolicy", K::Str),
];
static LOCAL_REF: &[Field] = &[f(1, "name", K::Str)];
static POD_SPEC: &[Field] = &[
    r(2, "containers", K::Msg(CONTAINER)),
    f(3, "restartPolicy", K::Str),
    p(4, "terminationGracePeriodSeconds", K::Int),
    p(5, "activeDeadlineSeconds", K::Int),
    f(6, "dnsPolicy", K::Str),
    f(7, "nodeSelector", K::MapStr),
    f(8, "serviceAccountName", K::Str),
    f(10, "nodeName", K::Str),
    f(11, "hostNetwork", K::Bool),
    r(15, "imagePullSecrets", K::Msg(LOCAL_REF)),
    f(16, "hostname", K::Str),
    f(17, "subdomain", K::Str),
    f(19, "schedulerName", K::Str),
    r(20, "initContainers", K::Msg(CONTAINER)),
    p(21, "automountServiceAccountToken", K::Bool),
    f(24, "priorityClassName", K::Str),
];
static POD_TEMPLATE: &[Field] = &[
    f(1, "metadata", K::Msg(OBJECT_META)),
    f(2, "spec", K::Msg(POD_SPEC)),
];
static ROLLING_UPDATE: &[Field] = &[
    f(1, "maxUnavailable", K::IntOrString),
    f(2, "maxSurge", K::IntOrString),
];
static STRATEGY: &[Field] = &[
    f(1, "type", K::Str),
    f(2, "rollingUpdate", K::Msg(ROLLING_UPDATE)),
];
static DEPLOYMENT_SPEC: &[Field] = &[
    p(1, "replicas", K::Int),
    f(2, "selector", K::Msg(LABEL_SELECTOR)),
    f(3, "template", K::Msg(POD_TEMPLATE)),
    f(4, "strategy", K::Msg(STRATEGY)),
    f(5, "minReadySeconds", K::Int),
    p(6, "revisionHistoryLimit", K::Int),
    f(7, "paused", K::Bool),
    p(9, "progressDeadlineSeconds", K::Int),
];
static SERVICE_PORT: &[Field] = &[
    f(1, "name", K::Str),
    f(2, "protocol", K::Str),
    f(3, "port", K::Int),
    f(4, "targetPort", K::IntOrString),
    f(5, "nodePort", K::Int),
    f(6, "appProtocol", K::Str),
];
static SERVICE_SPEC: &[Field] = &[
    r(1, "ports", K::Msg(SERVICE_PORT)),
    f(2, "selector", K::MapStr),
    f(3, "clusterIP", K::Str),
    f(4, "type", K::Str),
    r(5, "externalIPs", K::Str),
    f(7, "sessionAffinity", K::Str),
    f(10, "externalName", K::Str),
    r(18, "clusterIPs", K::Str),
];
static NAMESPACE_SPEC: &[Field] = &[r(1, "finalizers", K::Str)];
static RESOURCE_ATTRS: &[Field] = &[
    f(1, "namespace", K::Str),
    f(2, "verb", K::Str),
    f(3, "group", K::Str),
    f(4, "version", K::Str),
    f(5, "resource", K::Str),
    f(6, "subresource", K::Str),
    f(7, "name", K::Str),
];
static NON_RESOURCE_ATTRS: &[Field] = &[f(1, "path", K::Str), f(2, "verb", K::Str)];
static SSAR_SPEC: &[Field] = &[
    f(1, "resourceAttributes", K::Msg(RESOURCE_ATTRS)),
    f(2, "nonResourceAttributes", K::Msg(NON_RESOURCE_ATTRS)),
];
static SSRR_SPEC: &[Field] = &[f(1, "namespace", K::Str)];
static BOUND_REF: &[Field] = &[
    f(1, "kind", K::Str),
    f(2, "apiVersion", K::Str),
    f(3, "name", K::Str),
    f(4, "uid", K::Str),
];
static TOKEN_SPEC: &[Field] = &[
    r(1, "audiences", K::Str),
    f(3, "boundObjectRef", K::Msg(BOUND_REF)),
    p(4, "expirationSeconds", K::Int),
];

fn meta_and(spec: &'static [Field]) -> Vec<Field> {
    vec![
        f(1, "metadata", K::Msg(OBJECT_META)),
        f(2, "spec", K::Msg(spec)),
    ]
}

/// The top-level table of a kind, if its protobuf form is understood.
fn kind_fields(kind: &str) -> Option<Vec<Field>> {
    Some(match kind {
        "Namespace" => meta_and(NAMESPACE_SPEC),
        "Pod" => meta_and(POD_SPEC),
        "Deployment" => meta_and(DEPLOYMENT_SPEC),
        "Service" => meta_and(SERVICE_SPEC),
        "SelfSubjectAccessReview" => meta_and(SSAR_SPEC),
        "SelfSubjectRulesReview" => meta_and(SSRR_SPEC),
        "SelfSubjectReview" => vec![f(1, "metadata", K::Msg(OBJECT_META))],
        "TokenRequest" => meta_and(TOKEN_SPEC),
        "ConfigMap" => vec![
            f(1, "metadata", K::Msg(OBJECT_META)),
            f(2, "data", K::MapStr),
            f(3, "binaryData", K::MapBytes),
            p(4, "immutable", K::Bool),
        ],
        "Secret" => vec![
            f(1, "metadata", K::Msg(OBJECT_META)),
            f(2, "data", K::MapBytes),
            f(3, "type", K::Str),
            f(4, "stringData", K::MapStr),
            p(5, "immutable", K::Bool),
        ],
        "ServiceAccount" => vec![
            f(1, "metadata", K::Msg(OBJECT_META)),
            r(3, "imagePullSecrets", K::Msg(LOCAL_REF)),
            p(4, "automountServiceAccountToken", K::Bool),
        ],
        _ => return None,
    })
}

/// The protobuf wire reader.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn malformed() -> ApiError {
    ApiError::bad_request("the protobuf request body is malformed")
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn varint(&mut self) -> Result<u64, ApiError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = *self.buf.get(self.pos).ok_or_else(malformed)?;
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(malformed())
    }

    fn bytes(&mut self) -> Result<&'a [u8], ApiError> {
        let len = usize::try_from(self.varint()?).map_err(|_| malformed())?;
        let end = self
            .pos
            .checked_add(len)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(malformed)?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next field: number, wire type, and the value (varint or bytes).
    fn field(&mut self) -> Result<(u64, Wire<'a>), ApiError> {
        let key = self.varint()?;
        let (num, wt) = (key >> 3, key & 7);
        let w = match wt {
            0 => Wire::Varint(self.varint()?),
            2 => Wire::Len(self.bytes()?),
            1 => {
                self.skip(8)?;
                Wire::Other
            }
            5 => {
                self.skip(4)?;
                Wire::Other
            }
            _ => return Err(malformed()),
        };
        Ok((num, w))
    }

    fn skip(&mut self, n: usize) -> Result<(), ApiError> {
        self.pos = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(malformed)?;
        Ok(())
    }
}

enum Wire<'a> {
    Varint(u64),
    Len(&'a [u8]),
    Other,
}

/// How deep messages may nest: a peer cannot make us recurse without bound.
const MAX_DEPTH: usize = 32;

fn text(b: &[u8]) -> Result<String, ApiError> {
    String::from_utf8(b.to_vec()).map_err(|_| malformed())
}

fn map_entry(b: &[u8], value: K, depth: usize) -> Result<(String, Value), ApiError> {
    let mut rd = Reader::new(b);
    let (mut k, mut v) = (String::new(), Value::Null);
    while !rd.done() {
        match rd.field()? {
            (1, Wire::Len(x)) => k = text(x)?,
            (2, w) => v = scalar(value, w, depth)?,
            _ => {}
        }
    }
    if v.is_null() {
        v = match value {
            K::MapBytes | K::Str | K::MapStr => json!(""),
            _ => v,
        };
    }
    Ok((k, v))
}

fn scalar(kind: K, w: Wire<'_>, depth: usize) -> Result<Value, ApiError> {
    use base64::Engine;
    Ok(match (kind, w) {
        (K::Str | K::MapStr, Wire::Len(b)) => json!(text(b)?),
        (K::MapBytes, Wire::Len(b)) => json!(base64::engine::general_purpose::STANDARD.encode(b)),
        (K::Int, Wire::Varint(v)) => json!(v as i64),
        (K::Bool, Wire::Varint(v)) => json!(v != 0),
        (K::Msg(fields), Wire::Len(b)) => message(fields, b, depth + 1)?,
        (K::MapQuantity, Wire::Len(b)) => {
            let mut rd = Reader::new(b);
            let mut s = String::new();
            while !rd.done() {
                if let (1, Wire::Len(x)) = rd.field()? {
                    s = text(x)?;
                }
            }
            json!(s)
        }
        (K::Time, Wire::Len(b)) => {
            let mut rd = Reader::new(b);
            let mut secs = 0i64;
            while !rd.done() {
                if let (1, Wire::Varint(v)) = rd.field()? {
                    secs = v as i64;
                }
            }
            if secs == 0 {
                Value::Null
            } else {
                time::OffsetDateTime::from_unix_timestamp(secs)
                    .map(|t| json!(crate::util::format_time(t)))
                    .unwrap_or(Value::Null)
            }
        }
        (K::IntOrString, Wire::Len(b)) => {
            let mut rd = Reader::new(b);
            let (mut is_str, mut i, mut s) = (false, 0i64, String::new());
            while !rd.done() {
                match rd.field()? {
                    (1, Wire::Varint(v)) => is_str = v == 1,
                    (2, Wire::Varint(v)) => i = v as i32 as i64,
                    (3, Wire::Len(x)) => s = text(x)?,
                    _ => {}
                }
            }
            if is_str { json!(s) } else { json!(i) }
        }
        _ => return Err(malformed()),
    })
}

fn message(fields: &[Field], b: &[u8], depth: usize) -> Result<Value, ApiError> {
    if depth > MAX_DEPTH {
        return Err(malformed());
    }
    let mut out = Map::new();
    let mut rd = Reader::new(b);
    while !rd.done() {
        let (num, w) = rd.field()?;
        let Some(fd) = fields.iter().find(|f| f.num == num) else {
            continue;
        };
        match fd.kind {
            K::MapStr | K::MapBytes | K::MapQuantity => {
                let Wire::Len(entry) = w else {
                    return Err(malformed());
                };
                let (k, v) = map_entry(entry, fd.kind, depth)?;
                let m = out.entry(fd.name).or_insert_with(|| json!({}));
                if let Some(m) = m.as_object_mut() {
                    m.insert(k, v);
                }
            }
            _ if fd.repeated => {
                let v = scalar(fd.kind, w, depth)?;
                let a = out.entry(fd.name).or_insert_with(|| json!([]));
                if let Some(a) = a.as_array_mut() {
                    a.push(v);
                }
            }
            _ => {
                let v = scalar(fd.kind, w, depth)?;
                let zero = matches!(&v, Value::Null)
                    || v == json!("")
                    || v == json!(0)
                    || v == json!(false);
                if !zero || fd.zero_matters {
                    out.insert(fd.name.into(), v);
                }
            }
        }
    }
    Ok(Value::Object(out))
}

/// Decodes a `k8s\0`-prefixed protobuf body into the JSON form of the object.
pub fn decode(body: &[u8]) -> Result<Value, ApiError> {
    let raw = body
        .strip_prefix(b"k8s\0")
        .ok_or_else(|| ApiError::bad_request("the protobuf body lacks the k8s magic prefix"))?;
    let mut rd = Reader::new(raw);
    let (mut api_version, mut kind, mut object) = (String::new(), String::new(), &[][..]);
    while !rd.done() {
        match rd.field()? {
            (1, Wire::Len(tm)) => {
                let mut t = Reader::new(tm);
                while !t.done() {
                    match t.field()? {
                        (1, Wire::Len(x)) => api_version = text(x)?,
                        (2, Wire::Len(x)) => kind = text(x)?,
                        _ => {}
                    }
                }
            }
            (2, Wire::Len(x)) => object = x,
            _ => {}
        }
    }
    let fields = kind_fields(&kind).ok_or_else(|| {
        ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (protobuf is understood only for a few built-in kinds, not {kind})"
        ))
    })?;
    let mut v = message(&fields, object, 0)?;
    v["apiVersion"] = json!(api_version);
    v["kind"] = json!(kind);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn ld(num: u64, data: &[u8], out: &mut Vec<u8>) {
        varint(num << 3 | 2, out);
        varint(data.len() as u64, out);
        out.extend_from_slice(data);
    }

    #[test]
    fn decodes_a_configmap_envelope() {
        let mut meta = Vec::new();
        ld(1, b"cm1", &mut meta);
        let mut label = Vec::new();
        ld(1, b"app", &mut label);
        ld(2, b"web", &mut label);
        ld(11, &label, &mut meta);
        let mut cm = Vec::new();
        ld(1, &meta, &mut cm);
        let mut entry = Vec::new();
        ld(1, b"k", &mut entry);
        ld(2, b"v", &mut entry);
        ld(2, &entry, &mut cm);
        varint(4 << 3, &mut cm);
        varint(1, &mut cm);
        let mut tm = Vec::new();
        ld(1, b"v1", &mut tm);
        ld(2, b"ConfigMap", &mut tm);
        let mut body = b"k8s\0".to_vec();
        ld(1, &tm, &mut body);
        ld(2, &cm, &mut body);
        let v = decode(&body).unwrap();
        assert_eq!(
            v,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm1", "labels": {"app": "web"}}, "data": {"k": "v"}, "immutable": true})
        );
        assert!(decode(&body[..body.len() - 3]).is_err());
        assert!(decode(b"nope").is_err());
    }
}
