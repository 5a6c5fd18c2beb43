//! What the hub knows about each RPC it serves, read from the descriptor
//! set at start-up: message types (for the Connect JSON mapping), whether it
//! streams, whether it is free of side effects (Connect GET), and the
//! `otterscale.api.feature` it belongs to (for feature gating). Changing
//! which features are on needs no rebuild: only this table and a flag.

use std::collections::{HashMap, HashSet};

use prost_reflect::{DescriptorPool, MessageDescriptor, Value};

use crate::{HubError, Result};

/// One RPC.
#[derive(Debug, Clone)]
pub struct MethodInfo {
    /// `/package.Service/Method`.
    pub path: String,
    pub input: MessageDescriptor,
    pub output: MessageDescriptor,
    pub server_streaming: bool,
    pub client_streaming: bool,
    /// `idempotency_level = NO_SIDE_EFFECTS`: Connect allows GET.
    pub no_side_effects: bool,
    /// The method's `otterscale.api.feature` name, if it has one.
    pub feature: Option<String>,
}

/// Every RPC of the descriptor set, by path.
#[derive(Debug, Clone)]
pub struct Methods {
    pub pool: DescriptorPool,
    by_path: HashMap<String, MethodInfo>,
    disabled: HashSet<String>,
}

/// `NO_SIDE_EFFECTS` in `google.protobuf.MethodOptions.IdempotencyLevel`.
const NO_SIDE_EFFECTS: i32 = 1;

impl Methods {
    /// Reads the descriptor set; `disabled` names features to switch off.
    pub fn load(descriptor_set: &[u8], disabled: &[String]) -> Result<Self> {
        Self::load_with(descriptor_set, &[], disabled)
    }

    /// Like [`Methods::load`], adding more descriptor sets (health,
    /// reflection) so every protocol can serve them too.
    pub fn load_with(descriptor_set: &[u8], extra: &[&[u8]], disabled: &[String]) -> Result<Self> {
        let mut pool = DescriptorPool::decode(descriptor_set)
            .map_err(|e| HubError::Config(format!("descriptor set: {e}")))?;
        for set in extra {
            pool.decode_file_descriptor_set(*set)
                .map_err(|e| HubError::Config(format!("descriptor set: {e}")))?;
        }
        let feature_ext = pool.get_extension_by_name("otterscale.api.feature");
        let mut by_path = HashMap::new();
        let mut known_features = HashSet::new();
        for service in pool.services() {
            for method in service.methods() {
                let options = method.options();
                let feature = feature_ext.as_ref().and_then(|ext| {
                    if !options.has_extension(ext) {
                        return None;
                    }
                    match options.get_extension(ext).as_ref() {
                        Value::Message(m) => m
                            .get_field_by_name("name")
                            .and_then(|v| v.as_str().map(str::to_owned)),
                        _ => None,
                    }
                });
                if let Some(f) = &feature {
                    known_features.insert(f.clone());
                }
                let no_side_effects = options
                    .get_field_by_name("idempotency_level")
                    .and_then(|v| v.as_enum_number())
                    == Some(NO_SIDE_EFFECTS);
                let path = format!("/{}/{}", service.full_name(), method.name());
                by_path.insert(
                    path.clone(),
                    MethodInfo {
                        path,
                        input: method.input(),
                        output: method.output(),
                        server_streaming: method.is_server_streaming(),
                        client_streaming: method.is_client_streaming(),
                        no_side_effects,
                        feature,
                    },
                );
            }
        }
        for name in disabled {
            if !known_features.contains(name) {
                let mut known: Vec<_> = known_features.iter().cloned().collect();
                known.sort();
                return Err(HubError::Config(format!(
                    "--disable-feature {name:?}: no RPC has that feature (known: {})",
                    known.join(", ")
                )));
            }
        }
        Ok(Self {
            pool,
            by_path,
            disabled: disabled.iter().cloned().collect(),
        })
    }

    pub fn get(&self, path: &str) -> Option<&MethodInfo> {
        self.by_path.get(path)
    }

    /// Whether every method of `service` (`package.Service`) belongs to a
    /// switched-off feature: such a service reports NOT_SERVING in health
    /// and is not listed by reflection.
    pub fn service_disabled(&self, service: &str) -> bool {
        let prefix = format!("/{service}/");
        let mut methods = self
            .by_path
            .values()
            .filter(|m| m.path.starts_with(&prefix))
            .peekable();
        methods.peek().is_some()
            && methods.all(|m| {
                m.feature
                    .as_ref()
                    .is_some_and(|f| self.disabled.contains(f))
            })
    }

    /// Unimplemented "feature NAME is disabled" when the method's feature is
    /// switched off; methods without the option are always served.
    pub fn check_enabled(&self, path: &str) -> std::result::Result<(), tonic::Status> {
        match self.by_path.get(path).and_then(|m| m.feature.as_ref()) {
            Some(f) if self.disabled.contains(f) => Err(tonic::Status::unimplemented(format!(
                "feature {f} is disabled"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_features_streaming_and_side_effects_from_descriptors() {
        let m = Methods::load(
            otter_proto::FILE_DESCRIPTOR_SET,
            &["runtime-enabled".into()],
        )
        .unwrap();
        assert!(m.service_disabled("otterscale.runtime.v1.RuntimeService"));
        assert!(!m.service_disabled("otterscale.resource.v1.ResourceService"));
        assert!(!m.service_disabled("no.such.Service"));
        let watch = m
            .get("/otterscale.resource.v1.ResourceService/Watch")
            .unwrap();
        assert!(watch.server_streaming);
        assert_eq!(watch.feature.as_deref(), Some("resource-enabled"));
        let manifest = m
            .get("/otterscale.link.v1.LinkService/GetAgentManifest")
            .unwrap();
        assert!(manifest.no_side_effects);
        assert!(
            !m.get("/otterscale.link.v1.LinkService/ListLinks")
                .unwrap()
                .no_side_effects
        );
        assert!(
            m.check_enabled("/otterscale.resource.v1.ResourceService/Get")
                .is_ok()
        );
        let e = m
            .check_enabled("/otterscale.runtime.v1.RuntimeService/Scale")
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert_eq!(e.message(), "feature runtime-enabled is disabled");
        assert!(Methods::load(otter_proto::FILE_DESCRIPTOR_SET, &["nope".into()]).is_err());
    }
}
