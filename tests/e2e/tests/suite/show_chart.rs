//! `RuntimeService.ShowChart` against real servers started here on
//! loopback: a chart repository over HTTPS (index.yaml and archives, with a
//! request log, served by this test), and Debian's `docker-registry` (the
//! distribution registry) over HTTPS with charts pushed by a real OCI
//! client (`oras` from PyPI). The archives are built by `tar`.
//!
//! The hub's address policy is set the way an operator allows one mirror:
//! `127.0.0.2/32` is allowed, every other loopback address is refused, a
//! redirect to one is refused too; a second hub shows what
//! `--chart-allow-private` opens.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::Full;
use otter_e2e::{TestHub, tools, with_token};
use otter_proto::runtime::v1::{
    ShowChartRequest, ShowChartResponse, runtime_service_client::RuntimeServiceClient,
};
use tonic::Code;

/// The address the hub is allowed to fetch from.
const MIRROR: [u8; 4] = [127, 0, 0, 2];

/// What the test's chart repository answers on a path.
#[derive(Clone)]
enum Answer {
    Body(Bytes),
    Redirect(String),
    /// The body, to a request with this `Authorization` only (401 else).
    Guarded(String, Bytes),
}

/// An HTTPS chart repository: answers from a table, logs every request.
struct Repo {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Repo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Repo {
    fn hits(&self, path: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == path)
            .count()
    }
}

async fn https_repo(
    ip: IpAddr,
    ca: &otter_pki::CertificateAuthority,
    routes: HashMap<String, Answer>,
) -> Repo {
    otter_pki::tls::install_default_provider();
    let (cert, key) = ca
        .issue_server_cert(&[ip.to_string(), "localhost".into()])
        .unwrap();
    let tls = otter_pki::tls::server_config(
        &cert,
        &key,
        ca.cert_pem(),
        otter_pki::tls::ClientAuth::None,
        &[b"http/1.1"],
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let routes = Arc::new(routes);
    let task = tokio::spawn({
        let log = log.clone();
        async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, routes, log) = (acceptor.clone(), routes.clone(), log.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req: http::Request<_>| {
                        let path = req.uri().path().to_owned();
                        log.lock().unwrap().push(path.clone());
                        let auth = req
                            .headers()
                            .get("authorization")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned);
                        let answer = routes.get(&path).cloned();
                        async move {
                            let resp = match answer {
                                Some(Answer::Body(b)) => http::Response::new(Full::new(b)),
                                Some(Answer::Guarded(want, b))
                                    if auth.as_deref() == Some(want.as_str()) =>
                                {
                                    http::Response::new(Full::new(b))
                                }
                                Some(Answer::Guarded(..)) => http::Response::builder()
                                    .status(401)
                                    .header("www-authenticate", "Basic realm=\"charts\"")
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                                Some(Answer::Redirect(to)) => http::Response::builder()
                                    .status(302)
                                    .header("location", to)
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                                None => http::Response::builder()
                                    .status(404)
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                            };
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        }
    });
    Repo { addr, log, task }
}

/// A chart archive made by `tar`, as `helm package` lays it out.
fn chart(dir: &Path, name: &str, version: &str) -> PathBuf {
    let src = dir.join(format!("src-{version}"));
    let root = src.join(name);
    std::fs::create_dir_all(root.join("templates")).unwrap();
    std::fs::write(
        root.join("Chart.yaml"),
        format!("apiVersion: v2\nname: {name}\nversion: {version}\n"),
    )
    .unwrap();
    std::fs::write(root.join("values.yaml"), values(version)).unwrap();
    std::fs::write(root.join("README.md"), readme(version)).unwrap();
    std::fs::write(root.join("templates/cm.yaml"), "kind: ConfigMap\n").unwrap();
    let archive = dir.join(format!("{name}-{version}.tgz"));
    let out = std::process::Command::new("tar")
        .arg("czf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .arg(name)
        .output()
        .unwrap();
    assert!(out.status.success(), "tar: {out:?}");
    archive
}

fn values(version: &str) -> String {
    format!("image:\n  tag: \"{version}\"\nreplicaCount: 2\n")
}

fn readme(version: &str) -> String {
    format!("# demo {version}\n")
}

fn sha256(data: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, data)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn show(repo: &str, name: &str, version: &str) -> ShowChartRequest {
    ShowChartRequest {
        repo_url: Some(repo.into()),
        chart_name: Some(name.into()),
        version: Some(version.into()),
    }
}

async fn hub_for_charts(ca_pem: &str, allow_private: bool) -> TestHub {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let ca_pem = ca_pem.to_owned();
    TestHub::start_with(dir, None, move |c| {
        c.charts = otter_hub::chart::ChartPolicy {
            allow_private,
            allow: vec!["127.0.0.2/32".parse().unwrap()],
            ca_pem: Some(ca_pem),
        };
    })
    .await
}

struct Client {
    client: RuntimeServiceClient<tonic::transport::Channel>,
    token: String,
}

impl Client {
    async fn of(hub: &TestHub) -> Self {
        Self {
            client: RuntimeServiceClient::new(hub.channel().await),
            token: hub.admin_token.clone(),
        }
    }

    async fn show(&mut self, req: ShowChartRequest) -> Result<ShowChartResponse, tonic::Status> {
        self.client
            .show_chart(with_token(req, &self.token))
            .await
            .map(tonic::Response::into_inner)
    }

    async fn refused(&mut self, req: ShowChartRequest, code: Code, says: &str) -> String {
        let e = self.show(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(e.message().contains(says), "{req:?}: {:?}", e.message());
        e.message().to_owned()
    }
}

fn shown(r: &ShowChartResponse) -> (String, String) {
    (
        String::from_utf8(r.values.clone().unwrap_or_default()).unwrap(),
        String::from_utf8(r.readme.clone().unwrap_or_default()).unwrap(),
    )
}

/// An HTTPS chart repository: latest stable, an exact version, a
/// constraint, the archive kept by digest, credentials for their own host
/// and never in an answer; every refusal of the address policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_repository_over_https() {
    let ca = otter_pki::CertificateAuthority::generate("chart test CA").unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut routes = HashMap::new();
    let mut entries = Vec::new();
    for version in ["1.0.0", "1.2.0", "2.0.0-rc.1"] {
        let archive = std::fs::read(chart(work.path(), "demo", version)).unwrap();
        entries.push(format!(
            "  - apiVersion: v2\n    name: demo\n    version: {version}\n    digest: {}\n    urls:\n      - charts/demo-{version}.tgz\n",
            sha256(&archive)
        ));
        routes.insert(
            format!("/repo/charts/demo-{version}.tgz"),
            Answer::Body(archive.into()),
        );
    }
    let index = format!("apiVersion: v1\nentries:\n  demo:\n{}", entries.concat());
    routes.insert(
        "/repo/index.yaml".into(),
        Answer::Body(index.clone().into()),
    );
    // The same index behind Basic credentials: the archives it names
    // resolve against /private/.
    use base64::Engine;
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("reader:s3cret")
    );
    routes.insert(
        "/private/index.yaml".into(),
        Answer::Guarded(basic.clone(), index.clone().into()),
    );
    for version in ["1.0.0", "1.2.0", "2.0.0-rc.1"] {
        let Some(Answer::Body(b)) = routes.get(&format!("/repo/charts/demo-{version}.tgz")) else {
            unreachable!()
        };
        let b = b.clone();
        routes.insert(
            format!("/private/charts/demo-{version}.tgz"),
            Answer::Guarded(basic.clone(), b),
        );
    }
    // Somewhere the hub may not go: loopback other than the mirror.
    let inside = https_repo(IpAddr::from([127, 0, 0, 1]), &ca, routes.clone()).await;
    routes.insert(
        "/moved/index.yaml".into(),
        Answer::Redirect(format!(
            "https://127.0.0.1:{}/repo/index.yaml",
            inside.addr.port()
        )),
    );
    routes.insert(
        "/loop/index.yaml".into(),
        Answer::Redirect("/loop/index.yaml".into()),
    );
    // Where it goes is never connected to: the downgrade is refused first.
    routes.insert(
        "/down/index.yaml".into(),
        Answer::Redirect("http://127.0.0.2:1/repo/index.yaml".into()),
    );
    let mirror = https_repo(IpAddr::from(MIRROR), &ca, routes).await;
    let base = format!("https://{}", mirror.addr);
    let repo = format!("{base}/repo");

    let hub = hub_for_charts(ca.cert_pem(), false).await;
    let mut c = Client::of(&hub).await;

    // Latest stable (the release candidate is skipped), exact, constraint.
    let latest = c.show(show(&repo, "demo", "")).await.unwrap();
    assert_eq!(shown(&latest), (values("1.2.0"), readme("1.2.0")));
    let exact = c.show(show(&repo, "demo", "1.0.0")).await.unwrap();
    assert_eq!(shown(&exact), (values("1.0.0"), readme("1.0.0")));
    let pre = c.show(show(&repo, "demo", "2.0.0-rc.1")).await.unwrap();
    assert_eq!(shown(&pre).0, values("2.0.0-rc.1"));
    let within = c.show(show(&repo, "demo", "~1.0")).await.unwrap();
    assert_eq!(shown(&within).0, values("1.0.0"));
    // Shown again: the index is read again, the archive comes from the
    // cache (kept by its verified digest).
    assert_eq!(mirror.hits("/repo/charts/demo-1.2.0.tgz"), 1);
    let again = c.show(show(&repo, "demo", "")).await.unwrap();
    assert_eq!(again, latest);
    assert_eq!(mirror.hits("/repo/charts/demo-1.2.0.tgz"), 1);
    assert!(mirror.hits("/repo/index.yaml") >= 5);

    // Connect GET, as a browser's cached read of a side-effect-free method.
    let message = serde_json::json!({"repoUrl": repo, "chartName": "demo", "version": "1.2.0"});
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("connect", "v1")
        .append_pair("encoding", "json")
        .append_pair("message", &message.to_string())
        .finish();
    let req = http::Request::get(format!(
        "/otterscale.runtime.v1.RuntimeService/ShowChart?{query}"
    ))
    .header("authorization", format!("Bearer {}", hub.admin_token))
    .body(Full::new(Bytes::new()))
    .unwrap();
    let (status, _, body) =
        otter_e2e::http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(answer["values"].as_str().unwrap())
        .unwrap();
    assert_eq!(decoded, values("1.2.0").as_bytes());

    // Credentials in the URL reach their own host, and no answer repeats them.
    let private = format!("https://reader:s3cret@{}/private", mirror.addr);
    let shown_private = c.show(show(&private, "demo", "1.0.0")).await.unwrap();
    assert_eq!(shown(&shown_private).0, values("1.0.0"));
    let wrong = format!("https://reader:guess@{}/private", mirror.addr);
    let message = c
        .refused(show(&wrong, "demo", ""), Code::PermissionDenied, "401")
        .await;
    assert!(
        !message.contains("guess") && !message.contains("reader"),
        "{message}"
    );

    // What is not there.
    c.refused(
        show(&repo, "nope", ""),
        Code::NotFound,
        "chart nope not found",
    )
    .await;
    c.refused(show(&repo, "demo", "9.9.9"), Code::NotFound, "9.9.9")
        .await;
    c.refused(show(&repo, "demo", "^3"), Code::NotFound, "^3")
        .await;
    c.refused(
        show(&format!("{base}/nothing"), "demo", ""),
        Code::NotFound,
        "404",
    )
    .await;
    // Requests that are wrong.
    c.refused(show("", "demo", ""), Code::InvalidArgument, "repo_url")
        .await;
    c.refused(show(&repo, "", ""), Code::InvalidArgument, "chart_name")
        .await;
    c.refused(
        show(&repo, "../etc", ""),
        Code::InvalidArgument,
        "chart_name",
    )
    .await;
    c.refused(
        show(&format!("ftp://{}", mirror.addr), "demo", ""),
        Code::InvalidArgument,
        "scheme",
    )
    .await;
    c.refused(
        show(&repo, "demo", "not a version!"),
        Code::InvalidArgument,
        "version",
    )
    .await;

    // The address policy: loopback by address, by name, behind a redirect;
    // the metadata address; a redirect loop; a downgrade to plain HTTP.
    let loopback = format!("https://127.0.0.1:{}/repo", inside.addr.port());
    c.refused(
        show(&loopback, "demo", ""),
        Code::PermissionDenied,
        "loopback",
    )
    .await;
    let by_name = format!("https://localhost:{}/repo", inside.addr.port());
    let message = c
        .refused(
            show(&by_name, "demo", ""),
            Code::PermissionDenied,
            "localhost resolves to",
        )
        .await;
    // Which address a name resolved to is the hub's business, not the
    // caller's: its resolver answers for no internal name.
    assert!(!message.contains("127.0.0.1"), "{message}");
    c.refused(
        show(&format!("{base}/moved"), "demo", ""),
        Code::PermissionDenied,
        "loopback",
    )
    .await;
    c.refused(
        show("http://169.254.169.254/latest", "demo", ""),
        Code::PermissionDenied,
        "link-local",
    )
    .await;
    c.refused(
        show(&format!("{base}/loop"), "demo", ""),
        Code::Unavailable,
        "redirected more than",
    )
    .await;
    c.refused(
        show(&format!("{base}/down"), "demo", ""),
        Code::PermissionDenied,
        "from HTTPS",
    )
    .await;
    assert_eq!(
        inside.hits("/repo/index.yaml"),
        0,
        "the hub never reached it"
    );
    hub.hub.shutdown().await;

    // A hub allowed private addresses fetches from loopback by name.
    let open = hub_for_charts(ca.cert_pem(), true).await;
    let mut c = Client::of(&open).await;
    let r = c.show(show(&by_name, "demo", "")).await.unwrap();
    assert_eq!(shown(&r), (values("1.2.0"), readme("1.2.0")));
    assert_eq!(inside.hits("/repo/index.yaml"), 1);
    open.hub.shutdown().await;
}

/// An OCI registry (Debian's docker-registry over HTTPS) with charts pushed
/// by `oras`: latest stable among tags in no particular order (build
/// metadata written `_` in a tag), an exact version, what is missing, a
/// registry address outside the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_registry_with_charts_pushed_by_oras() {
    let Some(registry_bin) = tools::tool(
        PathBuf::from("/usr/bin/docker-registry"),
        "Debian's docker-registry",
        "run `scripts/setup.sh apt`",
    ) else {
        return;
    };
    let Some(python) = tools::venv_python() else {
        return;
    };
    let ca = otter_pki::CertificateAuthority::generate("registry test CA").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (cert, key) = ca
        .issue_server_cert(&["127.0.0.2".into(), "localhost".into()])
        .unwrap();
    std::fs::write(d.join("registry.crt"), cert).unwrap();
    std::fs::write(d.join("registry.key"), key).unwrap();
    std::fs::write(d.join("ca.pem"), ca.cert_pem()).unwrap();
    let port = {
        let l = std::net::TcpListener::bind((IpAddr::from(MIRROR), 0)).unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = SocketAddr::from((MIRROR, port));
    std::fs::write(
        d.join("config.yml"),
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\nhttp:\n  addr: {addr}\n  secret: chart-test\n  tls:\n    certificate: {root}/registry.crt\n    key: {root}/registry.key\n",
            root = d.display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(registry_bin);
    cmd.arg("serve").arg(d.join("config.yml"));
    let scratch = tempfile::tempdir().unwrap();
    let registry = tools::daemon_at(cmd, addr, dir);
    let script = tools::workspace_root().join("tests/e2e/tests/fixtures/oras_push.py");
    // Pushed out of version order, a prerelease the newest.
    for version in ["1.0.0", "2.0.0-rc.1", "1.3.0+build.7", "1.2.0"] {
        let archive = chart(scratch.path(), "demo", version);
        let config = scratch.path().join(format!("config-{version}.json"));
        std::fs::write(
            &config,
            format!(r#"{{"apiVersion":"v2","name":"demo","version":"{version}"}}"#),
        )
        .unwrap();
        let mut push = tokio::process::Command::new(&python);
        push.arg(&script)
            .arg(addr.to_string())
            .arg("charts/demo")
            .arg(version)
            .arg(&archive)
            .arg(&config)
            .env("REQUESTS_CA_BUNDLE", registry.dir().join("ca.pem"));
        let out = tools::run_bounded(&mut push, std::time::Duration::from_secs(60)).await;
        assert!(out.status.success(), "oras push {version}: {out:?}");
    }

    let hub = hub_for_charts(ca.cert_pem(), false).await;
    let mut c = Client::of(&hub).await;
    let repo = format!("oci://{addr}/charts");
    let latest = c.show(show(&repo, "demo", "")).await.unwrap();
    assert_eq!(
        shown(&latest),
        (values("1.3.0+build.7"), readme("1.3.0+build.7"))
    );
    let exact = c.show(show(&repo, "demo", "1.0.0")).await.unwrap();
    assert_eq!(shown(&exact), (values("1.0.0"), readme("1.0.0")));
    let within = c.show(show(&repo, "demo", "~1.2")).await.unwrap();
    assert_eq!(shown(&within).0, values("1.2.0"));
    let build = c.show(show(&repo, "demo", "1.3.0+build.7")).await.unwrap();
    assert_eq!(build, latest);
    c.refused(show(&repo, "demo", "9.9.9"), Code::NotFound, "9.9.9")
        .await;
    c.refused(show(&repo, "nope", ""), Code::NotFound, "nope")
        .await;
    let outside = format!("oci://127.0.0.1:{port}/charts");
    c.refused(
        show(&outside, "demo", ""),
        Code::PermissionDenied,
        "loopback",
    )
    .await;
    hub.hub.shutdown().await;
    drop(registry);
}
