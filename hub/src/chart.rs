//! `RuntimeService.ShowChart`: the values.yaml and README of a Helm chart in
//! an HTTP(S) chart repository (`index.yaml`) or an OCI registry
//! (`oci://host/path`), the way `helm show` finds them.
//!
//! The request names no cluster, so the hub fetches, never an agent. It is
//! an outbound fetch on a caller's behalf, which makes it the hub's one
//! server-side request forgery surface; so:
//! - every address the hub would connect to (each redirect's too) is
//!   checked before connecting: loopback, private, link-local (the cloud
//!   metadata address among them), shared and unspecified addresses are
//!   refused unless the operator allows them (`--chart-allow-private`, or
//!   `--chart-allow-cidr` for one mirror's range). Host names are checked
//!   where they are resolved, on the connection's own lookup, so a name
//!   cannot resolve to one address for the check and another to connect;
//! - at most [`MAX_REDIRECTS`] redirects, never from HTTPS down to HTTP,
//!   and credentials in the repository URL go to its own host only;
//! - every size is capped (index, manifest, tag list, archive, unpacked
//!   archive, each file) and a whole fetch has [`FETCH_TIMEOUT`];
//! - archives are kept by digest (verified), so a dashboard showing the
//!   same chart again costs no download;
//! - URLs are shown without their credentials, in errors and logs alike.

use std::{
    collections::VecDeque,
    io::Read,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty};
use hyper_util::{
    client::legacy::{
        Client,
        connect::{HttpConnector, dns::Name},
    },
    rt::TokioExecutor,
};
use ipnet::IpNet;
use otter_proto::runtime::v1::{ShowChartRequest, ShowChartResponse};
use tonic::Status;
use url::Url;

/// The method's path.
pub const SHOW_CHART: &str = "/otterscale.runtime.v1.RuntimeService/ShowChart";

/// Largest `index.yaml` read (public repositories' indexes run to tens of
/// MiB; the biggest are split by now).
pub const MAX_INDEX: usize = 32 << 20;
/// Largest chart archive, compressed.
pub const MAX_ARCHIVE: usize = 16 << 20;
/// Largest archive once unpacked, and largest file in it: Helm's own
/// limits, so a chart Helm installs is a chart the hub shows.
pub const MAX_UNPACKED: u64 = 100 << 20;
pub const MAX_FILE: u64 = 5 << 20;
/// Largest OCI manifest or tag list.
pub const MAX_REGISTRY_JSON: usize = 4 << 20;
/// Redirects followed per request.
pub const MAX_REDIRECTS: usize = 5;
/// One ShowChart, every request of it together.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Fetches at once, hub-wide: more are told to try again. Each may hold an
/// index of [`MAX_INDEX`] twice over while reading it.
pub const MAX_CONCURRENT_FETCHES: usize = 4;
/// Bytes of values and READMEs kept by digest, each entry counted with
/// [`CACHE_ENTRY_OVERHEAD`] more, and at most [`CACHE_ENTRIES`] of them.
pub const CACHE_BYTES: usize = 32 << 20;
const CACHE_ENTRY_OVERHEAD: usize = 4096;
const CACHE_ENTRIES: usize = 256;

const HELM_CONFIG: &str = "application/vnd.cncf.helm.config.v1+json";
const HELM_CHART: &str = "application/vnd.cncf.helm.chart.content.v1.tar+gzip";
/// Charts pushed by Helm before 3.8 use this layer type.
const LEGACY_CHART: &str = "application/tar+gzip";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Which addresses the hub may fetch charts from.
#[derive(Debug, Clone, Default)]
pub struct ChartPolicy {
    /// Any address at all (tests, a hub inside a trusted network).
    pub allow_private: bool,
    /// Ranges allowed although they are not public (an internal mirror).
    pub allow: Vec<IpNet>,
    /// Extra CA (PEM) to trust besides the public roots.
    pub ca_pem: Option<String>,
}

impl ChartPolicy {
    /// Why `ip` may not be fetched from, if it may not.
    pub fn refuses(&self, ip: IpAddr) -> Option<&'static str> {
        if self.allow_private || self.allow.iter().any(|net| net.contains(&ip)) {
            return None;
        }
        non_public(ip)
    }
}

/// What kind of non-public address `ip` is, or `None` for a public one.
pub fn non_public(ip: IpAddr) -> Option<&'static str> {
    let v4 = match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(v6) => {
            // A v4 address in v6 clothing is judged as the v4 one: mapped
            // (::ffff:a.b.c.d), compatible (::a.b.c.d), NAT64
            // (64:ff9b::/96, which reaches the v4 network behind it) and
            // 6to4 (2002:aabb:ccdd::/48).
            let s = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                let [a, b] = hi.to_be_bytes();
                let [c, d] = lo.to_be_bytes();
                IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d))
            };
            if let Some(v4) = v6.to_ipv4_mapped() {
                return non_public(IpAddr::V4(v4));
            }
            if s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
                return non_public(embedded(s[6], s[7]));
            }
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return non_public(embedded(s[6], s[7]));
            }
            if s[0] == 0x2002 {
                return non_public(embedded(s[1], s[2]));
            }
            let first = s[0];
            return if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if first & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if first & 0xffc0 == 0xfec0 {
                Some("site-local")
            } else if first & 0xfe00 == 0xfc00 {
                Some("private (unique local)")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if s[..2] == [0x64, 0xff9b] && s[2] == 1 {
                Some("local-use translation (64:ff9b:1::/48)")
            } else if s[..2] == [0x2001, 0] {
                Some("Teredo")
            } else if s[..4] == [0x100, 0, 0, 0] {
                Some("discard-only")
            } else {
                None
            };
        }
    };
    let [a, b, c, _] = v4.octets();
    if v4.is_loopback() {
        Some("loopback")
    } else if v4.is_private() {
        Some("private")
    } else if v4.is_link_local() {
        Some("link-local (cloud metadata lives here)")
    } else if a == 100 && (64..128).contains(&b) {
        Some("shared (carrier-grade NAT)")
    } else if v4.is_unspecified() || a == 0 {
        Some("unspecified")
    } else if (a, b, c) == (192, 0, 0) || (a == 198 && (b & 0xfe) == 18) {
        Some("special-purpose (IETF protocol assignments, benchmarking)")
    } else if matches!((a, b, c), (192, 0, 2) | (198, 51, 100) | (203, 0, 113)) {
        Some("documentation")
    } else if v4.is_broadcast() || v4.is_multicast() || a >= 240 {
        Some("broadcast, multicast or reserved")
    } else {
        None
    }
}

/// The error a refused address becomes on its way through the connector;
/// found again in the error's chain and answered PermissionDenied.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

const ALLOW_HINT: &str =
    "an operator may allow such addresses with --chart-allow-cidr or --chart-allow-private";

/// The refusal of an address the caller wrote.
fn refused_message(ip: IpAddr, kind: &str) -> String {
    format!("{ip} is a {kind} address: the hub does not fetch charts from it ({ALLOW_HINT})")
}

/// The refusal of a name: which address it resolved to stays in the hub's
/// log, so the hub's resolver does not answer for internal names.
fn refused_name_message(host: &str) -> String {
    format!("{host} resolves to an address the hub does not fetch charts from ({ALLOW_HINT})")
}

/// The connector's name lookup, with the policy applied to every address a
/// name resolves to: the addresses connected to are the ones checked.
#[derive(Clone)]
struct CheckedResolver {
    policy: Arc<ChartPolicy>,
}

impl tower::Service<Name> for CheckedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = BoxFuture<'static, std::io::Result<Self::Response>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            // One refused address refuses the name: connecting to "the
            // other one" would leave the choice to whoever runs its DNS.
            for addr in &addrs {
                if let Some(kind) = policy.refuses(addr.ip()) {
                    tracing::info!(%host, ip = %addr.ip(), kind, "ShowChart refused a name's address");
                    return Err(std::io::Error::other(Refused(refused_name_message(&host))));
                }
            }
            Ok(addrs.into_iter())
        })
    }
}

type HttpsClient =
    Client<hyper_rustls::HttpsConnector<HttpConnector<CheckedResolver>>, Empty<Bytes>>;

/// A chart's two files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChartFiles {
    pub values: Bytes,
    pub readme: Bytes,
}

impl ChartFiles {
    /// What keeping it costs, as the cache counts.
    fn size(&self) -> usize {
        self.values.len() + self.readme.len() + CACHE_ENTRY_OVERHEAD
    }
}

/// One fetch's place among [`MAX_CONCURRENT_FETCHES`], held by the fetch
/// and by its blocking work alike.
type Slot = Arc<tokio::sync::OwnedSemaphorePermit>;

/// Fetches charts for ShowChart.
pub struct Charts {
    client: HttpsClient,
    policy: Arc<ChartPolicy>,
    cache: Mutex<VecDeque<(String, Arc<ChartFiles>)>>,
    fetches: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Charts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charts")
            .field("policy", &self.policy)
            .finish()
    }
}

/// A URL as it may be shown: without credentials.
fn shown(url: &Url) -> String {
    let mut url = url.clone();
    let _ = url.set_username("");
    let _ = url.set_password(None);
    // Queries carry tokens and signatures (`?token=`, presigned blob URLs).
    if url.query().is_some() {
        url.set_query(Some("…"));
    }
    url.set_fragment(None);
    url.to_string()
}

/// Credentials a request carries: the repository URL's own, for its host.
#[derive(Clone)]
struct Credentials {
    origin: url::Origin,
    basic: Option<String>,
}

impl Credentials {
    fn of(url: &Url) -> Self {
        use base64::Engine;
        let basic = (!url.username().is_empty()).then(|| {
            let user = percent_decode(url.username());
            let pass = percent_decode(url.password().unwrap_or(""));
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
        });
        Self {
            origin: url.origin(),
            basic,
        }
    }

    fn none() -> Self {
        Self {
            origin: url::Origin::new_opaque(),
            basic: None,
        }
    }

    /// `Authorization` for a request to `url`: only to the origin the
    /// credentials came with (a redirect elsewhere goes without them).
    fn header(&self, url: &Url, bearer: Option<&str>) -> Option<String> {
        if url.origin() != self.origin {
            return None;
        }
        match (bearer, &self.basic) {
            (Some(token), _) => Some(format!("Bearer {token}")),
            (None, Some(basic)) => Some(format!("Basic {basic}")),
            (None, None) => None,
        }
    }
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// A registry's bearer challenge (`WWW-Authenticate: Bearer realm=…`).
#[derive(Debug, PartialEq, Eq)]
pub struct Challenge {
    pub realm: String,
    pub service: Option<String>,
    pub scope: Option<String>,
}

/// Reads a bearer challenge; `None` for other schemes.
pub fn parse_challenge(value: &str) -> Option<Challenge> {
    let rest = value.trim();
    let (scheme, params) = rest.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let (mut realm, mut service, mut scope) = (None, None, None);
    let mut rest = params.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim(), &after[end..])
        };
        match key.as_str() {
            "realm" => realm = Some(value.to_owned()),
            "service" => service = Some(value.to_owned()),
            "scope" => scope = Some(value.to_owned()),
            _ => {}
        }
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge {
        realm: realm?,
        service,
        scope,
    })
}

/// `index.yaml` (JSON is YAML too, and Helm accepts both).
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Index {
    api_version: Option<String>,
    #[serde(default)]
    entries: Entries,
}

/// Most versions of one chart read from an index; more are skipped.
const MAX_VERSIONS: usize = 10_000;

std::thread_local! {
    /// The chart an index is being read for (set around [`parse_index`],
    /// which runs on a blocking thread of its own): serde's derive has no
    /// way to hand a key to the value's reader, and without it every
    /// chart's entries would be built only to be dropped.
    static WANTED: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// The versions of the wanted chart; every other chart's are skipped as
/// they are read, so a big index costs its bytes, not a structure of all
/// of it.
#[derive(Debug, Default)]
struct Entries(Vec<IndexEntry>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Charts;
        impl<'de> serde::de::Visitor<'de> for Charts {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of chart names to their versions")
            }
            fn visit_unit<E>(self) -> Result<Entries, E> {
                Ok(Entries::default())
            }
            fn visit_none<E>(self) -> Result<Entries, E> {
                Ok(Entries::default())
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Entries, A::Error> {
                let mut found = Entries::default();
                while let Some(key) = map.next_key::<String>()? {
                    if WANTED.with(|w| *w.borrow() == key) {
                        found = map.next_value::<Entries>()?;
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(found)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Entries, A::Error> {
                // The list of one chart's versions.
                let mut versions = Vec::new();
                while let Some(entry) = seq.next_element::<Option<IndexEntry>>()? {
                    if let Some(entry) = entry
                        && versions.len() < MAX_VERSIONS
                    {
                        versions.push(entry);
                    }
                }
                Ok(Entries(versions))
            }
        }
        d.deserialize_any(Charts)
    }
}

#[derive(Debug, Clone, serde::Deserialize)]
struct IndexEntry {
    #[serde(default)]
    version: String,
    #[serde(default)]
    urls: Vec<String>,
    #[serde(default)]
    digest: Option<String>,
}

/// The version a request asks for, among `available` (as written): an
/// exact match first, else the highest that satisfies the constraint
/// (empty: any stable version, as Helm's "latest").
pub fn pick_version<'a>(
    wanted: &str,
    available: impl Iterator<Item = &'a str>,
) -> Result<Option<&'a str>, Status> {
    let available: Vec<&str> = available.collect();
    if !wanted.is_empty()
        && let Some(exact) = available.iter().find(|v| **v == wanted)
    {
        return Ok(Some(exact));
    }
    let req = if wanted.is_empty() {
        None
    } else {
        // Helm writes constraints with spaces between parts ("> 1, < 2"
        // or ">1 <2"); Cargo's syntax wants commas.
        let normal = wanted
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
        Some(semver::VersionReq::parse(&normal).map_err(|e| {
            Status::invalid_argument(format!(
                "invalid version: {wanted:?} is neither a version nor a constraint ({e})"
            ))
        })?)
    };
    Ok(available
        .into_iter()
        .filter_map(|v| {
            let parsed = semver::Version::parse(v.strip_prefix('v').unwrap_or(v)).ok()?;
            let fits = match &req {
                Some(req) => req.matches(&parsed),
                None => parsed.pre.is_empty(),
            };
            fits.then_some((parsed, v))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, v)| v))
}

/// `values.yaml` and the README at the root of a chart archive, checked as
/// Helm's loader checks them (one top directory, no absolute or `..`
/// paths, a `Chart.yaml`), within the size limits.
///
/// The archive is read raw: GNU long-name and PAX records are skipped, not
/// applied, so a hostile archive cannot make the reader buffer a name of
/// many megabytes. A chart's root files have short names, which the
/// headers themselves carry (with the ustar prefix).
pub fn unpack(archive: &[u8]) -> Result<ChartFiles, Status> {
    let bad = |why: String| Status::failed_precondition(format!("not a chart archive: {why}"));
    let gz = flate2::read::GzDecoder::new(archive);
    let mut tar = tar::Archive::new(gz.take(MAX_UNPACKED + 1));
    let mut files = ChartFiles::default();
    let (mut chart_yaml, mut values, mut readme) = (false, None, None);
    let mut total: u64 = 0;
    let entries = tar.entries().map_err(|e| bad(e.to_string()))?.raw(true);
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        let kind = entry.header().entry_type();
        if !kind.is_file() {
            continue;
        }
        let path = entry.path().map_err(|e| bad(e.to_string()))?.into_owned();
        // Shown in errors, so cut short.
        let shown_path = || {
            path.display()
                .to_string()
                .chars()
                .take(200)
                .collect::<String>()
        };
        let mut parts = Vec::new();
        for c in path.components() {
            match c {
                std::path::Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
                std::path::Component::CurDir => {}
                _ => return Err(bad(format!("unsafe path {}", shown_path()))),
            }
        }
        if parts.len() < 2 {
            return Err(bad(format!(
                "{} is not inside the chart's directory",
                shown_path()
            )));
        }
        let size = entry.header().size().map_err(|e| bad(e.to_string()))?;
        total = total.saturating_add(size);
        if total > MAX_UNPACKED {
            return Err(Status::resource_exhausted(format!(
                "the chart unpacks to over {MAX_UNPACKED} bytes"
            )));
        }
        let name = parts[1..].join("/");
        let wanted = if name == "Chart.yaml" {
            chart_yaml = true;
            false
        } else if name == "values.yaml" {
            values.is_none()
        } else {
            readme.is_none()
                && ["readme.md", "readme.txt", "readme"]
                    .iter()
                    .any(|r| name.eq_ignore_ascii_case(r))
        };
        if !wanted {
            continue;
        }
        if size > MAX_FILE {
            return Err(Status::resource_exhausted(format!(
                "{name} of the chart is over {MAX_FILE} bytes"
            )));
        }
        let mut content = Vec::with_capacity(size.min(MAX_FILE) as usize);
        entry
            .by_ref()
            .take(MAX_FILE + 1)
            .read_to_end(&mut content)
            .map_err(|e| bad(e.to_string()))?;
        if content.len() as u64 > MAX_FILE {
            return Err(Status::resource_exhausted(format!(
                "{name} of the chart is over {MAX_FILE} bytes"
            )));
        }
        if name == "values.yaml" {
            let content = content
                .strip_prefix("\u{feff}".as_bytes())
                .map(<[u8]>::to_vec)
                .unwrap_or(content);
            values = Some(Bytes::from(content));
        } else {
            readme = Some(Bytes::from(content));
        }
    }
    if !chart_yaml {
        return Err(bad("it has no Chart.yaml".into()));
    }
    files.values = values.unwrap_or_default();
    files.readme = readme.unwrap_or_default();
    Ok(files)
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, data))
}

/// A chart name as it may appear in a URL path: Helm's names, no more.
fn check_chart_name(name: &str) -> Result<(), Status> {
    let ok = !name.is_empty()
        && name.len() <= 250
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "invalid chart_name: {name:?} is not a chart name (letters, digits, '-', '_', '.')"
        )))
    }
}

/// `index.yaml` or a chart path resolved against a repository URL the way
/// Helm does: the base's path taken as a directory, its query kept.
fn resolve(base: &Url, reference: &str) -> Result<Url, Status> {
    let mut dir = base.clone();
    if !dir.path().ends_with('/') {
        let path = format!("{}/", dir.path());
        dir.set_path(&path);
    }
    let mut url = dir
        .join(reference)
        .map_err(|e| Status::failed_precondition(format!("bad URL {reference:?}: {e}")))?;
    if url.query().is_none() && base.query().is_some() && url.origin() == base.origin() {
        url.set_query(base.query());
    }
    Ok(url)
}

impl Charts {
    pub fn new(policy: ChartPolicy) -> crate::Result<Self> {
        let policy = Arc::new(policy);
        let tls = otter_pki::tls::public_client_config(policy.ca_pem.as_deref(), &[])
            .map_err(|e| crate::HubError::Config(format!("chart CA: {e}")))?;
        let mut http = HttpConnector::new_with_resolver(CheckedResolver {
            policy: policy.clone(),
        });
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(2)
            .build(https);
        Ok(Self {
            client,
            policy,
            cache: Mutex::new(VecDeque::new()),
            fetches: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_FETCHES)),
        })
    }

    /// Serves one ShowChart request.
    pub async fn show(&self, req: &ShowChartRequest) -> Result<ShowChartResponse, Status> {
        let repo = req.repo_url.as_deref().unwrap_or("").trim();
        let name = req.chart_name.as_deref().unwrap_or("").trim();
        let version = req.version.as_deref().unwrap_or("").trim();
        if repo.is_empty() {
            return Err(Status::invalid_argument(
                "invalid repo_url: repository URL is required",
            ));
        }
        if name.is_empty() {
            return Err(Status::invalid_argument(
                "invalid chart_name: chart name is required",
            ));
        }
        check_chart_name(name)?;
        if repo.len() > 2048 || version.len() > 128 {
            return Err(Status::invalid_argument(
                "invalid request: repo_url is limited to 2048 bytes, version to 128",
            ));
        }
        let repo = Url::parse(repo)
            .map_err(|e| Status::invalid_argument(format!("invalid repo_url: not a URL ({e})")))?;
        // The slot is shared with the blocking work (parsing, unpacking),
        // which outlives a fetch that timed out: it is free only when
        // that work is done too.
        let Ok(slot) = self.fetches.clone().try_acquire_owned().map(Slot::new) else {
            return Err(Status::unavailable(
                "too many chart fetches at once; try again shortly",
            ));
        };
        let fetch = async {
            match repo.scheme() {
                "oci" => self.fetch_from_registry(&repo, name, version, &slot).await,
                "http" | "https" => {
                    self.fetch_from_repository(&repo, name, version, &slot)
                        .await
                }
                other => Err(Status::invalid_argument(format!(
                    "invalid repo_url: scheme {other:?} (use https://, http:// or oci://)"
                ))),
            }
        };
        let files = tokio::time::timeout(FETCH_TIMEOUT, fetch)
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "fetching {name} from {} took over {} s",
                    shown(&repo),
                    FETCH_TIMEOUT.as_secs()
                ))
            })??;
        Ok(ShowChartResponse {
            values: Some(files.values.to_vec()),
            readme: Some(files.readme.to_vec()),
        })
    }

    fn cached(&self, digest: &str) -> Option<Arc<ChartFiles>> {
        let cache = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        cache
            .iter()
            .find(|(d, _)| d == digest)
            .map(|(_, files)| files.clone())
    }

    fn remember(&self, digest: String, files: Arc<ChartFiles>) {
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if files.size() > CACHE_BYTES || cache.iter().any(|(d, _)| *d == digest) {
            return;
        }
        let mut used: usize = cache.iter().map(|(_, f)| f.size()).sum();
        while used + files.size() > CACHE_BYTES || cache.len() >= CACHE_ENTRIES {
            match cache.pop_front() {
                Some((_, old)) => used -= old.size(),
                None => break,
            }
        }
        cache.push_back((digest, files));
    }

    /// Checks a URL before any request to it: scheme, and the address when
    /// the host is written as one (names are checked as they resolve).
    fn check_url(&self, url: &Url) -> Result<(), Status> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Status::failed_precondition(format!(
                "{} is not an http(s) URL",
                shown(url)
            )));
        }
        let ip = match url.host() {
            Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
            Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
            Some(url::Host::Domain(_)) => return Ok(()),
            None => {
                return Err(Status::invalid_argument(format!(
                    "{} has no host",
                    shown(url)
                )));
            }
        };
        match self.policy.refuses(ip) {
            Some(kind) => Err(Status::permission_denied(refused_message(ip, kind))),
            None => Ok(()),
        }
    }

    /// GETs `url`, following redirects (each checked, never HTTPS → HTTP),
    /// reading at most `max` bytes of the answer. Answers other than 2xx
    /// come back as `Err(Ok(response head))` for the caller to judge.
    async fn get(
        &self,
        url: &Url,
        accept: Option<&str>,
        credentials: &Credentials,
        bearer: Option<&str>,
        max: usize,
    ) -> Result<Result<Bytes, http::response::Parts>, Status> {
        let mut url = url.clone();
        for _ in 0..=MAX_REDIRECTS {
            self.check_url(&url)?;
            let mut req = http::Request::get(url.as_str()).header(
                http::header::USER_AGENT,
                concat!("otterscale-link/", env!("CARGO_PKG_VERSION")),
            );
            if let Some(accept) = accept {
                req = req.header(http::header::ACCEPT, accept);
            }
            if let Some(auth) = credentials.header(&url, bearer) {
                req = req.header(http::header::AUTHORIZATION, auth);
            }
            let req = req
                .body(Empty::new())
                .map_err(|e| Status::invalid_argument(format!("bad URL {}: {e}", shown(&url))))?;
            let resp = self.client.request(req).await.map_err(|e| {
                let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
                while let Some(err) = source {
                    // An I/O error's `source` skips the error it wraps:
                    // look inside.
                    let inner = err
                        .downcast_ref::<std::io::Error>()
                        .and_then(|io| io.get_ref())
                        .and_then(|e| e.downcast_ref::<Refused>());
                    if let Some(refused) = inner.or_else(|| err.downcast_ref::<Refused>()) {
                        return Status::permission_denied(refused.0.clone());
                    }
                    source = err.source();
                }
                // What failed stays in the log: a caller learns no more
                // than that, so the hub is no port scanner.
                tracing::debug!(url = %shown(&url), error = %otter_tunnel::error_chain(&e), "chart fetch failed");
                Status::unavailable(format!("cannot fetch {}: connection failed", shown(&url)))
            })?;
            let status = resp.status();
            if status.is_redirection() {
                let location = resp
                    .headers()
                    .get(http::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| {
                        Status::unavailable(format!(
                            "{} redirected without a Location",
                            shown(&url)
                        ))
                    })?;
                let next = url.join(location).map_err(|e| {
                    Status::unavailable(format!("{} redirected to a bad URL: {e}", shown(&url)))
                })?;
                if url.scheme() == "https" && next.scheme() != "https" {
                    return Err(Status::permission_denied(format!(
                        "{} redirected from HTTPS to {}: refused",
                        shown(&url),
                        shown(&next)
                    )));
                }
                url = next;
                continue;
            }
            let (parts, body) = resp.into_parts();
            if !status.is_success() {
                return Ok(Err(parts));
            }
            if let Some(len) = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                && len > max as u64
            {
                return Err(too_large(&url, max));
            }
            let body = http_body_util::Limited::new(body, max)
                .collect()
                .await
                .map_err(|e| {
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        too_large(&url, max)
                    } else {
                        Status::unavailable(format!("reading {}: {e}", shown(&url)))
                    }
                })?;
            return Ok(Ok(body.to_bytes()));
        }
        Err(Status::unavailable(format!(
            "{} redirected more than {MAX_REDIRECTS} times",
            shown(&url)
        )))
    }

    /// An HTTP(S) chart repository: `index.yaml`, then the archive.
    async fn fetch_from_repository(
        &self,
        repo: &Url,
        name: &str,
        version: &str,
        slot: &Slot,
    ) -> Result<Arc<ChartFiles>, Status> {
        let credentials = Credentials::of(repo);
        let index_url = resolve(repo, "index.yaml")?;
        let raw = match self
            .get(&index_url, None, &credentials, None, MAX_INDEX)
            .await?
        {
            Ok(body) => body,
            Err(head) => return Err(answered(&index_url, head.status)),
        };
        let chart = name.to_owned();
        let held = slot.clone();
        let index: Index = tokio::task::spawn_blocking(move || {
            let _held = held;
            parse_index(&raw, &chart)
        })
        .await
        .map_err(|e| Status::internal(format!("index parser: {e}")))??;
        if index.api_version.is_none() {
            return Err(Status::failed_precondition(format!(
                "{} has no apiVersion: not a chart repository index",
                shown(&index_url)
            )));
        }
        let entries = index.entries.0;
        if entries.is_empty() {
            return Err(Status::not_found(format!(
                "chart {name} not found in {}",
                shown(repo)
            )));
        }
        let picked = pick_version(version, entries.iter().map(|e| e.version.as_str()))?
            .ok_or_else(|| not_found_version(name, version, repo))?;
        let entry = entries
            .iter()
            .find(|e| e.version == picked)
            .ok_or_else(|| not_found_version(name, version, repo))?;
        let first = entry.urls.first().ok_or_else(|| {
            Status::failed_precondition(format!(
                "chart {name} {picked} in {} has no downloadable URLs",
                shown(repo)
            ))
        })?;
        let digest = entry
            .digest
            .as_deref()
            .map(|d| d.trim_start_matches("sha256:").to_ascii_lowercase());
        // A chart fetched with credentials is that caller's: it is neither
        // served from the cache nor kept in it (a digest is no secret).
        let cacheable = credentials.basic.is_none();
        if cacheable && let Some(files) = digest.as_deref().and_then(|d| self.cached(d)) {
            return Ok(files);
        }
        let archive_url = resolve(repo, first)?;
        let archive = match self
            .get(&archive_url, None, &credentials, None, MAX_ARCHIVE)
            .await?
        {
            Ok(body) => body,
            Err(head) => return Err(answered(&archive_url, head.status)),
        };
        let actual = sha256_hex(&archive);
        if let Some(expected) = digest
            && expected != actual
        {
            return Err(Status::data_loss(format!(
                "{} has digest {actual}, the index says {expected}",
                shown(&archive_url)
            )));
        }
        self.unpack_and_keep(actual, archive, cacheable, slot).await
    }

    async fn unpack_and_keep(
        &self,
        digest: String,
        archive: Bytes,
        cacheable: bool,
        slot: &Slot,
    ) -> Result<Arc<ChartFiles>, Status> {
        if cacheable && let Some(files) = self.cached(&digest) {
            return Ok(files);
        }
        let held = slot.clone();
        let files = tokio::task::spawn_blocking(move || {
            let _held = held;
            unpack(&archive)
        })
        .await
        .map_err(|e| Status::internal(format!("chart unpacker: {e}")))??;
        let files = Arc::new(files);
        if cacheable {
            self.remember(digest, files.clone());
        }
        Ok(files)
    }

    /// An OCI registry: tag (listing tags for "latest" or a constraint),
    /// manifest, then the chart layer.
    async fn fetch_from_registry(
        &self,
        repo: &Url,
        name: &str,
        version: &str,
        slot: &Slot,
    ) -> Result<Arc<ChartFiles>, Status> {
        let host = repo.host_str().ok_or_else(|| {
            Status::invalid_argument("invalid repo_url: oci:// needs a registry host")
        })?;
        let authority = match repo.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let path = repo.path().trim_matches('/');
        let repository = if path.is_empty() {
            name.to_owned()
        } else {
            format!("{path}/{name}")
        };
        let mut base = Url::parse(&format!("https://{authority}/v2/{repository}/"))
            .map_err(|e| Status::invalid_argument(format!("invalid repo_url: {e}")))?;
        let _ = base.set_username(repo.username());
        let _ = base.set_password(repo.password());
        let registry = Registry {
            charts: self,
            credentials: Credentials::of(&base),
            base,
            repository,
        };
        let tag = match semver::Version::parse(version) {
            Ok(_) => version.replace('+', "_"),
            Err(_) => registry.pick_tag(name, version, repo).await?,
        };
        let manifest_url = registry.url(&format!("manifests/{tag}"))?;
        let manifest = match registry
            .get(&manifest_url, Some(OCI_MANIFEST), MAX_REGISTRY_JSON)
            .await?
        {
            Ok(body) => body,
            Err(status) if status == http::StatusCode::NOT_FOUND => {
                return Err(not_found_version(name, version, repo));
            }
            Err(status) => return Err(answered(&manifest_url, status)),
        };
        let manifest: Manifest = serde_json::from_slice(&manifest).map_err(|e| {
            Status::failed_precondition(format!(
                "{} is not an OCI manifest: {e}",
                shown(&manifest_url)
            ))
        })?;
        if manifest.config.media_type != HELM_CONFIG {
            return Err(Status::failed_precondition(format!(
                "{}:{tag} is not a Helm chart (config media type {:?})",
                registry.repository, manifest.config.media_type
            )));
        }
        let layer = manifest
            .layers
            .iter()
            .find(|l| l.media_type == HELM_CHART || l.media_type == LEGACY_CHART)
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "{}:{tag} has no chart layer",
                    registry.repository
                ))
            })?;
        let hex = layer
            .digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "chart layer digest {:?} is not sha256",
                    layer.digest
                ))
            })?
            .to_ascii_lowercase();
        let cacheable = registry.credentials.basic.is_none();
        if cacheable && let Some(files) = self.cached(&hex) {
            return Ok(files);
        }
        if layer.size > MAX_ARCHIVE as u64 {
            return Err(too_large(&manifest_url, MAX_ARCHIVE));
        }
        let blob_url = registry.url(&format!("blobs/sha256:{hex}"))?;
        let archive = match registry.get(&blob_url, None, MAX_ARCHIVE).await? {
            Ok(body) => body,
            Err(status) => return Err(answered(&blob_url, status)),
        };
        let actual = sha256_hex(&archive);
        if actual != hex {
            return Err(Status::data_loss(format!(
                "the chart layer of {}:{tag} has digest {actual}, the manifest says {hex}",
                registry.repository
            )));
        }
        self.unpack_and_keep(actual, archive, cacheable, slot).await
    }
}

/// Reads `apiVersion` and `chart`'s versions from an index (JSON, else
/// YAML).
fn parse_index(raw: &[u8], chart: &str) -> Result<Index, Status> {
    WANTED.with(|w| *w.borrow_mut() = chart.to_owned());
    let bad = |e: String| {
        Status::failed_precondition(format!("the repository's index.yaml does not parse: {e}"))
    };
    if let Ok(index) = serde_json::from_slice::<Index>(raw) {
        return Ok(index);
    }
    // Big indexes have millions of nodes: room for them, with the
    // parser's defences against alias bombs left on.
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = 20_000_000;
    budget.max_events = 40_000_000;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    serde_saphyr::from_slice_with_options(raw, options).map_err(|e| bad(e.to_string()))
}

fn too_large(url: &Url, max: usize) -> Status {
    Status::resource_exhausted(format!("{} is over the limit of {max} bytes", shown(url)))
}

fn not_found_version(name: &str, version: &str, repo: &Url) -> Status {
    let which = if version.is_empty() {
        "no stable version".to_owned()
    } else {
        format!("no version matching {version:?}")
    };
    Status::not_found(format!("chart {name}: {which} found in {}", shown(repo)))
}

/// A refusal of the server, as the caller's code.
fn answered(url: &Url, status: http::StatusCode) -> Status {
    let text = format!("{} answered {status}", shown(url));
    match status.as_u16() {
        404 | 410 => Status::not_found(text),
        401 | 403 => Status::permission_denied(text),
        429 | 502..=504 => Status::unavailable(text),
        _ => Status::failed_precondition(text),
    }
}

#[derive(serde::Deserialize)]
struct Manifest {
    config: Descriptor,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: String,
    digest: String,
    #[serde(default)]
    size: u64,
}

#[derive(serde::Deserialize)]
struct TagList {
    #[serde(default)]
    tags: Option<Vec<String>>,
}

#[derive(serde::Deserialize)]
struct Token {
    token: Option<String>,
    access_token: Option<String>,
}

/// One repository of a registry, with its bearer token once it asked for
/// one.
struct Registry<'a> {
    charts: &'a Charts,
    credentials: Credentials,
    base: Url,
    repository: String,
}

impl Registry<'_> {
    fn url(&self, tail: &str) -> Result<Url, Status> {
        self.base
            .join(tail)
            .map_err(|e| Status::invalid_argument(format!("invalid reference {tail:?}: {e}")))
    }

    /// GETs from the registry, answering a bearer challenge once
    /// (anonymous, or with the URL's credentials as Basic at the realm).
    async fn get(
        &self,
        url: &Url,
        accept: Option<&str>,
        max: usize,
    ) -> Result<Result<Bytes, http::StatusCode>, Status> {
        let head = match self
            .charts
            .get(url, accept, &self.credentials, None, max)
            .await?
        {
            Ok(body) => return Ok(Ok(body)),
            Err(head) => head,
        };
        if head.status != http::StatusCode::UNAUTHORIZED {
            return Ok(Err(head.status));
        }
        let Some(challenge) = head
            .headers
            .get_all(http::header::WWW_AUTHENTICATE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(parse_challenge)
        else {
            return Ok(Err(head.status));
        };
        let token = self.token(&challenge).await?;
        Ok(self
            .charts
            .get(url, accept, &self.credentials, Some(&token), max)
            .await?
            .map_err(|head| head.status))
    }

    async fn token(&self, challenge: &Challenge) -> Result<String, Status> {
        let mut realm = Url::parse(&challenge.realm).map_err(|e| {
            Status::unavailable(format!("the registry's token realm is not a URL: {e}"))
        })?;
        {
            let mut query = realm.query_pairs_mut();
            if let Some(service) = &challenge.service {
                query.append_pair("service", service);
            }
            let scope = challenge
                .scope
                .clone()
                .unwrap_or_else(|| format!("repository:{}:pull", self.repository));
            query.append_pair("scope", &scope);
        }
        // The realm is another origin as a rule: the URL's credentials go
        // there only if it is the registry's own origin (scheme and port
        // included, so never in the clear).
        let same_origin = realm.origin() == self.base.origin();
        let credentials = if same_origin {
            Credentials {
                origin: realm.origin(),
                basic: self.credentials.basic.clone(),
            }
        } else {
            Credentials::none()
        };
        let body = match self
            .charts
            .get(&realm, None, &credentials, None, MAX_REGISTRY_JSON)
            .await?
        {
            Ok(body) => body,
            Err(head) => return Err(answered(&realm, head.status)),
        };
        let token: Token = serde_json::from_slice(&body).map_err(|e| {
            Status::unavailable(format!("the registry's token answer does not parse: {e}"))
        })?;
        token
            .token
            .or(token.access_token)
            .ok_or_else(|| Status::unavailable("the registry's token answer carries no token"))
    }

    /// The tag of the version asked for, from the repository's tag list
    /// (`_` in a tag stands for `+`, which tags cannot hold).
    async fn pick_tag(&self, name: &str, version: &str, repo: &Url) -> Result<String, Status> {
        let url = self.url("tags/list")?;
        let body = match self.get(&url, None, MAX_REGISTRY_JSON).await? {
            Ok(body) => body,
            Err(status) if status == http::StatusCode::NOT_FOUND => {
                return Err(Status::not_found(format!(
                    "chart {name} not found in {}",
                    shown(repo)
                )));
            }
            Err(status) => return Err(answered(&url, status)),
        };
        let list: TagList = serde_json::from_slice(&body).map_err(|e| {
            Status::failed_precondition(format!("{} does not parse: {e}", shown(&url)))
        })?;
        let versions: Vec<String> = list
            .tags
            .unwrap_or_default()
            .into_iter()
            .map(|t| t.replace('_', "+"))
            .filter(|v| semver::Version::parse(v).is_ok())
            .collect();
        let picked = pick_version(version, versions.iter().map(String::as_str))?
            .ok_or_else(|| not_found_version(name, version, repo))?;
        Ok(picked.replace('+', "_"))
    }
}

/// Serves a ShowChart call (as gRPC: the protocol layer made it one).
pub async fn serve(
    charts: Arc<Charts>,
    req: http::Request<crate::forward::HttpBody>,
) -> http::Response<crate::forward::HttpBody> {
    struct Show(Arc<Charts>);
    impl tonic::server::UnaryService<ShowChartRequest> for Show {
        type Response = ShowChartResponse;
        type Future = BoxFuture<'static, Result<tonic::Response<ShowChartResponse>, Status>>;
        fn call(&mut self, req: tonic::Request<ShowChartRequest>) -> Self::Future {
            let charts = self.0.clone();
            Box::pin(async move {
                let req = req.into_inner();
                let answer = charts.show(&req).await;
                let repo = req
                    .repo_url
                    .as_deref()
                    .and_then(|r| Url::parse(r).ok())
                    .map(|u| shown(&u))
                    .unwrap_or_default();
                match &answer {
                    Ok(_) => tracing::debug!(%repo, chart = ?req.chart_name, "chart shown"),
                    Err(status) => {
                        tracing::info!(%repo, chart = ?req.chart_name, code = ?status.code(), "ShowChart refused")
                    }
                }
                answer.map(tonic::Response::new)
            })
        }
    }
    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default())
        .apply_max_message_size_config(Some(crate::limits::MAX_PUBLIC_MESSAGE), None);
    grpc.unary(Show(charts), req).await.map(|b| {
        b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
            .boxed_unsync()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_non_public_addresses_unless_allowed() {
        let policy = ChartPolicy::default();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::10.0.0.1",
            "64:ff9b::a00:5",
            "64:ff9b:1::1",
            "2002:a00:1::1",
            "2001:0:1::1",
            "fec0::1",
            "100::1",
            "192.0.0.8",
            "198.18.0.1",
            "192.0.2.1",
            "203.0.113.9",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(policy.refuses(ip).is_some(), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "2606:4700::1",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(policy.refuses(ip), None, "{ip}");
        }
        let mirror = ChartPolicy {
            allow: vec!["10.1.0.0/16".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(mirror.refuses("10.1.2.3".parse().unwrap()), None);
        assert!(mirror.refuses("10.2.0.1".parse().unwrap()).is_some());
        let open = ChartPolicy {
            allow_private: true,
            ..Default::default()
        };
        assert_eq!(open.refuses("127.0.0.1".parse().unwrap()), None);
    }

    #[test]
    fn picks_versions_as_helm_does() {
        let tags = ["1.0.0", "2.0.0-rc.1", "1.3.0+build.7", "1.2.0", "junk"];
        let pick = |v: &str| pick_version(v, tags.iter().copied()).unwrap();
        assert_eq!(pick(""), Some("1.3.0+build.7"), "latest stable");
        assert_eq!(pick("1.2.0"), Some("1.2.0"), "exact");
        assert_eq!(pick("2.0.0-rc.1"), Some("2.0.0-rc.1"), "exact prerelease");
        assert_eq!(pick("~1.2"), Some("1.2.0"));
        assert_eq!(pick(">=1.0.0 <1.3.0"), Some("1.2.0"));
        assert_eq!(pick("^3"), None);
        assert!(pick_version("not a version!", tags.iter().copied()).is_err());
        let only_pre = ["2.0.0-rc.1"];
        assert_eq!(pick_version("", only_pre.iter().copied()).unwrap(), None);
    }

    #[test]
    fn reads_bearer_challenges() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.example/token",service="reg.example",scope="repository:charts/demo:pull""#
            ),
            Some(Challenge {
                realm: "https://auth.example/token".into(),
                service: Some("reg.example".into()),
                scope: Some("repository:charts/demo:pull".into()),
            })
        );
        assert_eq!(parse_challenge(r#"Basic realm="x""#), None);
        assert_eq!(parse_challenge("Bearer service=x"), None);
    }

    #[test]
    fn resolves_like_helm() {
        let base = Url::parse("https://h.example/charts?token=1").unwrap();
        assert_eq!(
            resolve(&base, "index.yaml").unwrap().as_str(),
            "https://h.example/charts/index.yaml?token=1"
        );
        assert_eq!(
            resolve(&base, "https://mirror.example/x.tgz")
                .unwrap()
                .as_str(),
            "https://mirror.example/x.tgz"
        );
        assert_eq!(
            resolve(&base, "/x.tgz").unwrap().as_str(),
            "https://h.example/x.tgz?token=1"
        );
    }

    #[test]
    fn credentials_go_to_their_own_origin_only() {
        let repo = Url::parse("https://user:p%40ss@h.example/charts").unwrap();
        let c = Credentials::of(&repo);
        let header = c.header(&repo, None).unwrap();
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(header.strip_prefix("Basic ").unwrap())
            .unwrap();
        assert_eq!(decoded, b"user:p@ss");
        assert_eq!(
            c.header(&Url::parse("https://other.example/x").unwrap(), None),
            None
        );
        assert_eq!(shown(&repo), "https://h.example/charts");
    }

    fn archive(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut tar = tar::Builder::new(Vec::new());
        for (path, content) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, path, *content).unwrap();
        }
        let raw = tar.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn reads_only_the_wanted_charts_versions() {
        let yaml = "apiVersion: v1\nentries:\n  other:\n    - version: 1.0.0\n  demo:\n    - version: 1.2.0\n      urls: [a.tgz]\n    - null\n";
        let index = parse_index(yaml.as_bytes(), "demo").unwrap();
        assert_eq!(index.api_version.as_deref(), Some("v1"));
        let versions: Vec<&str> = index.entries.0.iter().map(|e| e.version.as_str()).collect();
        assert_eq!(versions, ["1.2.0"]);
        let json = r#"{"apiVersion":"v1","entries":{"demo":[{"version":"2.0.0"}],"x":null}}"#;
        assert_eq!(
            parse_index(json.as_bytes(), "demo")
                .unwrap()
                .entries
                .0
                .len(),
            1
        );
        assert!(
            parse_index(json.as_bytes(), "nope")
                .unwrap()
                .entries
                .0
                .is_empty()
        );
    }

    #[test]
    fn long_names_are_skipped_not_buffered() {
        let long = format!("demo/{}/values.yaml", "d".repeat(300));
        let a = archive(&[
            ("demo/Chart.yaml", b"name: demo\n"),
            (long.as_str(), b"not: this\n"),
            ("demo/values.yaml", b"this: one\n"),
        ]);
        assert_eq!(&unpack(&a).unwrap().values[..], b"this: one\n");
    }

    #[test]
    fn unpacks_root_files_only() {
        let a = archive(&[
            (
                "demo/Chart.yaml",
                b"apiVersion: v2\nname: demo\nversion: 1.0.0\n",
            ),
            ("demo/charts/sub/values.yaml", b"sub: true\n"),
            ("demo/values.yaml", b"\xef\xbb\xbfreplicas: 1\n"),
            ("demo/docs/README.md", b"not this one"),
            ("demo/ReadMe.md", b"# Demo\n"),
        ]);
        let files = unpack(&a).unwrap();
        assert_eq!(&files.values[..], b"replicas: 1\n");
        assert_eq!(&files.readme[..], b"# Demo\n");

        let none = archive(&[("demo/values.yaml", b"a: 1\n")]);
        assert_eq!(
            unpack(&none).unwrap_err().code(),
            tonic::Code::FailedPrecondition
        );
        let flat = archive(&[("Chart.yaml", b"name: x\n")]);
        assert_eq!(
            unpack(&flat).unwrap_err().code(),
            tonic::Code::FailedPrecondition
        );
        let big = vec![b'x'; MAX_FILE as usize + 1];
        let over = archive(&[
            ("demo/Chart.yaml", b"name: x\n"),
            ("demo/values.yaml", &big),
        ]);
        assert_eq!(
            unpack(&over).unwrap_err().code(),
            tonic::Code::ResourceExhausted
        );
        assert!(unpack(b"not gzip").is_err());
    }
}
