//! The hub CA, created on first start and kept in the store, and the
//! server certificate of the hub's listeners.

use otter_pki::CertificateAuthority;
use serde::{Deserialize, Serialize};

use crate::{
    Result,
    store::{Store, StoreExt, tree},
};

#[derive(Serialize, Deserialize)]
struct CaRecord {
    cert_pem: String,
    key_pem: String,
    created: i64,
}

/// Loads the CA from the store, creating (and storing) it on first start.
/// Keeping it is what lets agents reconnect after a hub restart with the
/// certificates they have.
pub fn load_or_create_ca(store: &dyn Store) -> Result<CertificateAuthority> {
    if let Some(rec) = store.get::<CaRecord>(tree::META, "ca")? {
        return Ok(CertificateAuthority::from_pem(&rec.cert_pem, &rec.key_pem)?);
    }
    let ca = CertificateAuthority::generate("OtterScale Link hub CA")?;
    store.put(
        tree::META,
        "ca",
        &CaRecord {
            cert_pem: ca.cert_pem().to_owned(),
            key_pem: ca.key_pem().to_owned(),
            created: crate::unix_now(),
        },
    )?;
    tracing::info!(fingerprint = %ca.fingerprint(), "created hub CA");
    Ok(ca)
}

/// Names for the hub's server certificate: the hosts of the external and
/// tunnel URLs, plus loopback names so the embedded default works.
pub fn server_names<'a>(urls: impl IntoIterator<Item = &'a url::Url>) -> Vec<String> {
    let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    for url in urls {
        if let Some(host) = url.host_str() {
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            if !names.contains(&host) {
                names.push(host);
            }
        }
    }
    names
}
