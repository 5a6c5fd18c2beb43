//! JSON ↔ `google.protobuf.Struct`, manifests in, objects out.

pub use otter_proto::json::to_struct;
use serde_json::Value;
use tonic::Status;

/// The annotation client-side apply leaves behind.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Largest manifest or body accepted (the apiserver takes 3 MiB).
pub const MAX_MANIFEST: usize = 3 * 1024 * 1024;

/// Drops `metadata.managedFields` and the last-applied annotation (and the
/// annotations map when that leaves it empty).
pub fn clean(obj: &mut Value) {
    let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    meta.remove("managedFields");
    if let Some(ann) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
        ann.remove(LAST_APPLIED);
        if ann.is_empty() {
            meta.remove("annotations");
        }
    }
}

/// An object for the caller: cleaned and converted.
pub fn object_out(mut v: Value) -> otter_proto::resource::v1::Resource {
    clean(&mut v);
    otter_proto::resource::v1::Resource {
        object: Some(to_struct(v)),
    }
}

/// One YAML or JSON document as a JSON object.
pub fn manifest(bytes: &[u8]) -> Result<Value, Status> {
    if bytes.is_empty() {
        return Err(Status::invalid_argument("manifest is empty"));
    }
    if bytes.len() > MAX_MANIFEST {
        return Err(Status::invalid_argument(format!(
            "manifest of {} bytes is over the limit of {MAX_MANIFEST}",
            bytes.len()
        )));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|e| Status::invalid_argument(format!("manifest is not UTF-8: {e}")))?;
    let trimmed = text.trim_start();
    let value: Value = if trimmed.starts_with('{') {
        serde_json::from_str(trimmed)
            .map_err(|e| Status::invalid_argument(format!("manifest is not valid JSON: {e}")))?
    } else {
        let mut docs: Vec<Value> = serde_saphyr::from_multiple(text)
            .map_err(|e| Status::invalid_argument(format!("manifest is not valid YAML: {e}")))?;
        docs.retain(|d| !d.is_null());
        match docs.len() {
            1 => docs.remove(0),
            0 => return Err(Status::invalid_argument("manifest holds no document")),
            n => {
                return Err(Status::invalid_argument(format!(
                    "manifest holds {n} documents; send exactly one"
                )));
            }
        }
    };
    if !value.is_object() {
        return Err(Status::invalid_argument(
            "manifest must be an object with apiVersion, kind and metadata",
        ));
    }
    Ok(value)
}

/// A string at a dotted path.
pub fn str_at<'a>(v: &'a Value, path: &str) -> Option<&'a str> {
    path.split('.')
        .try_fold(v, |v, k| v.get(k))
        .and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn clean_drops_managed_fields_and_last_applied() {
        let mut v = json!({"metadata": {"name": "a", "managedFields": [{}],
            "annotations": {LAST_APPLIED: "{}"}}, "data": {"k": "v"}});
        clean(&mut v);
        assert_eq!(v, json!({"metadata": {"name": "a"}, "data": {"k": "v"}}));
        let mut v = json!({"metadata": {"annotations": {LAST_APPLIED: "{}", "x": "y"}}});
        clean(&mut v);
        assert_eq!(v, json!({"metadata": {"annotations": {"x": "y"}}}));
    }

    #[test]
    fn manifests_in_yaml_and_json() {
        let y = manifest(b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n").unwrap();
        assert_eq!(str_at(&y, "metadata.name"), Some("a"));
        let j = manifest(br#"{"apiVersion":"v1","kind":"ConfigMap"}"#).unwrap();
        assert_eq!(j["kind"], "ConfigMap");
        let two = manifest(b"a: 1\n---\nb: 2\n").unwrap_err();
        assert!(two.message().contains("2 documents"), "{}", two.message());
        let bad = manifest(b"a: [1\n").unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        assert!(bad.message().contains("YAML"), "{}", bad.message());
        assert!(manifest(b"- 1\n").is_err());
        assert!(manifest(b"").is_err());
    }
}
