//! Helpers for the end-to-end tests: start a hub in a temp dir, start
//! agents joined the real way, and talk to the hub as a client would.
//!
//! # Layout
//! - [`TestHub`] — a hub on loopback ports with its own data dir.
//! - [`client_channel`] — a gRPC channel to the hub that trusts only its CA.
//! - [`with_token`] — adds the bearer token to a request.

use std::{path::PathBuf, sync::Arc, time::Duration};

use otter_hub::{Hub, HubConfig};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A hub for a test, with its data directory.
#[derive(Debug)]
pub struct TestHub {
    pub hub: Hub,
    pub dir: Arc<tempfile::TempDir>,
    pub admin_token: String,
}

impl TestHub {
    /// A hub on free loopback ports.
    pub async fn start() -> TestHub {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        Self::start_in(dir, None).await
    }

    /// A hub in `dir` (kept across restarts), on the ports of `previous`
    /// when given so agents find it again.
    pub async fn start_in(
        dir: Arc<tempfile::TempDir>,
        previous: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
    ) -> TestHub {
        let mut config = HubConfig::new(dir.path());
        config.api_listen = "127.0.0.1:0".parse().expect("address");
        config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
        if let Some((api, tunnel)) = previous {
            config.api_listen = api;
            config.tunnel_listen = tunnel;
        }
        config.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
        config.drain_timeout = Duration::from_secs(2);
        let hub = Hub::start(config).await.expect("hub starts");
        let admin_token = std::fs::read_to_string(dir.path().join("admin-token"))
            .expect("admin token file")
            .trim()
            .to_owned();
        TestHub {
            hub,
            dir,
            admin_token,
        }
    }

    pub fn api_url(&self) -> url::Url {
        url::Url::parse(&format!("https://localhost:{}", self.hub.api_addr.port())).expect("URL")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    pub async fn channel(&self) -> tonic::transport::Channel {
        client_channel(self.hub.api_addr, self.hub.ca_pem(), None).await
    }
}

/// A gRPC channel to `addr` over TLS, trusting only `ca_pem`, optionally
/// with a client certificate (cert PEM, key PEM).
pub async fn client_channel(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    client: Option<(&str, &str)>,
) -> tonic::transport::Channel {
    otter_pki::tls::install_default_provider();
    let tls = otter_pki::tls::client_config(ca_pem, client, &[b"h2"]).expect("client TLS config");
    let connector = TlsConnector::from(Arc::new(tls));
    tonic::transport::Endpoint::from_shared(format!("http://localhost:{}", addr.port()))
        .expect("endpoint")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let connector = connector.clone();
            async move {
                let tcp = TcpStream::connect(addr).await?;
                let tls = connector
                    .connect("localhost".try_into().expect("name"), tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .expect("connect to hub")
}

/// Wraps a message in a request carrying `token`.
pub fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("header value"),
    );
    req
}
