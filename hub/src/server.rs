//! Listeners and request dispatch.
//!
//! One TLS port serves the API (gRPC today; Connect, gRPC-Web and the
//! manifest URL share it). The tunnel port serves TLS + HTTP/2 tunnels on TCP
//! and QUIC tunnels on UDP with the same number.

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use otter_pki::tls;
use otter_proto::{
    fleet::v1::fleet_service_server::FleetServiceServer,
    link::v1::link_service_server::LinkServiceServer,
};
use otter_tunnel::{h2, quic};
use tokio::{net::TcpListener, sync::mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use url::Url;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tonic_health::ServingStatus;

use crate::{
    HubConfig, HubError, Result, authority, cors,
    forward::{self, HttpBody},
    link_service::LinkSvc,
    methods::Methods,
    metrics::Metrics,
    oidc::OidcVerifier,
    protocol::{self, Protocol},
    registry::Registry,
    store::{SledStore, Store},
    tokens,
};

/// Bounds a TLS handshake on the API port.
const API_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of an answer waiting for one caller's stream at the API port.
const API_SEND_BUFFER: usize = 64 * 1024;

/// What every handler shares.
pub struct HubState {
    pub config: HubConfig,
    pub store: Arc<dyn Store>,
    /// The hub's CAs and the TLS of its listeners (`<data dir>/ca.crt` holds
    /// the CAs clients should trust: `otter login --ca-file`, kubeconfigs).
    pub authority: authority::Authority,
    pub registry: Registry,
    pub external_url: Url,
    pub tunnel_urls: Vec<Url>,
    /// Every task the hub spawns, so shutdown can wait for all of them.
    pub tasks: TaskTracker,
    /// RPC table from the descriptor set: JSON mapping, feature gates.
    pub methods: Methods,
    /// Verifier of identity-provider tokens, when one is configured.
    pub oidc: Option<Arc<OidcVerifier>>,
    /// gRPC health: SERVING only while the store takes writes.
    pub health: tonic_health::server::HealthReporter,
    pub metrics: Arc<Metrics>,
    /// The audit log (or none).
    pub audit: crate::audit::Audit,
    /// Signs and verifies manifest URLs.
    pub manifest_key: ring::hmac::Key,
    /// How many tunnels are set up at once (paced reconnects).
    pub pacer: Arc<otter_tunnel::pace::Pacer>,
    /// How many Register calls are served at once.
    pub register_pacer: Arc<otter_tunnel::pace::Pacer>,
    /// Client of the Rancher management cluster, when one is configured.
    pub rancher: Option<crate::rancher::Rancher>,
    /// Upgraded connections of the Kubernetes API proxy, counted per user
    /// and per cluster.
    pub upgrades: Arc<crate::kube_proxy::Upgrades>,
    /// Open connections of the API port, per source.
    pub api_connections: Arc<crate::limits::ApiConnections>,
    /// Streams tied to the hub token that opened them.
    pub live: Arc<crate::credentials::LiveCredentials>,
    /// Connections to the other replicas (replicas with a peer port only).
    pub peers: Option<crate::peers::Peers>,
    /// When each cluster last renewed its certificate.
    pub renewals: crate::link_service::RenewalGaps,
    /// Fetches charts for ShowChart.
    pub charts: Arc<crate::chart::Charts>,
    /// Set once every listener is serving, cleared when shutdown starts:
    /// `/readyz` answers 503 outside that window.
    pub serving: std::sync::atomic::AtomicBool,
    /// Whether the store took the last probe write ([`watch_health`]
    /// keeps it current): what readiness reports, read without waiting on
    /// the store.
    pub store_writable: std::sync::atomic::AtomicBool,
    /// API connections that have not yet sent a whole request head: the
    /// same bounds as the tunnel port's handshakes (a fair share per
    /// source, the oldest dropped for a newcomer when full).
    pub api_pending: Arc<otter_tunnel::handshakes::Handshakes>,
    /// Session tickets of the tunnel port.
    pub tickets: crate::tickets::Tickets,
    /// Fan-out calls open per caller.
    pub fan_outs: Arc<crate::quota::Quota<String>>,
    /// Port-forward writes queued for their agents.
    pub uploads: crate::uploads::Uploads,
    /// Links' last-seen times, written off the tunnels' paths.
    pub last_seen: crate::tunnels::LastSeen,
    /// Which tunnels this replica holds, written off the admissions' path.
    pub claims: crate::peers::Claims,
    /// Links as listings read them, decoded once per change.
    pub links: crate::links::Links,
}

impl std::fmt::Debug for HubState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubState")
            .field("external_url", &self.external_url)
            .finish()
    }
}

/// Facts about the connection a request came in on.
#[derive(Debug)]
pub struct ConnInfo {
    pub remote: SocketAddr,
    /// Client certificate (verified against the hub CA), if one was shown.
    pub peer_cert: Option<Vec<u8>>,
    /// Came on the tunnel port ([`otter_tunnel::h2::LINK_ALPN`]): an agent
    /// renewing there, which may call Register with its certificate and
    /// nothing else.
    pub tunnel_port: bool,
}

impl ConnInfo {
    /// The remote address of the connection a request came on, as the
    /// audit log writes it (empty when unknown).
    pub fn remote_of(extensions: &http::Extensions) -> String {
        extensions
            .get::<Arc<ConnInfo>>()
            .map(|c| c.remote.to_string())
            .unwrap_or_default()
    }
}

/// A running hub.
#[derive(Debug)]
pub struct Hub {
    pub state: Arc<HubState>,
    pub api_addr: SocketAddr,
    pub tunnel_addr: SocketAddr,
    /// The admin token, when this start created it (first start only).
    pub admin_token: Option<String>,
    /// The ops ports bound (`--metrics-listen`, `--health-listen`).
    pub ops_addrs: Vec<(SocketAddr, crate::ops::Roles)>,
    initial_ca_pem: String,
    shutdown: CancellationToken,
    /// Stops admitting tunnels: the first step of a stop, so an agent that
    /// took its goodbye and dialled straight back is not admitted while
    /// the others are told (a child of `shutdown`).
    intake: CancellationToken,
    /// Stops the last-seen writer, which outlives the other tasks: tunnels
    /// closing at shutdown record their times to the end.
    last_seen_writer: (CancellationToken, tokio::task::JoinHandle<()>),
}

impl Hub {
    /// Opens the store, loads or creates the CA, binds every listener and
    /// starts serving.
    pub async fn start(mut config: HubConfig) -> Result<Hub> {
        config.validate()?;
        tls::install_default_provider();
        let open_files = crate::limits::raise_open_file_limit();
        let store: Arc<dyn Store> = match (&config.store, &config.store_key_file) {
            (Some(etcd), Some(key)) => {
                let etcd = etcd.clone();
                let opened =
                    tokio::task::spawn_blocking(move || crate::etcd::EtcdStore::connect(&etcd))
                        .await
                        .map_err(crate::store::StoreError::from)??;
                // Replicas sharing the store keep their own files (the CA
                // bundle, the first admin token) in the data dir.
                crate::store::create_private_dir(&config.data_dir).map_err(|source| {
                    crate::store::StoreError::DataDir {
                        path: config.data_dir.clone(),
                        source,
                    }
                })?;
                Arc::new(crate::sealed::SealedStore::new(
                    opened,
                    &crate::sealed::read_key(key)?,
                )?)
            }
            (None, Some(key)) => Arc::new(crate::sealed::SealedStore::new(
                open_store(&config.data_dir).await?,
                &crate::sealed::read_key(key)?,
            )?),
            (None, None) => {
                let sled = open_store(&config.data_dir).await?;
                crate::sealed::check_unsealed(&sled)?;
                Arc::new(sled)
            }
            (Some(_), None) => {
                return Err(HubError::Config(
                    "a store on etcd needs --store-key-file".into(),
                ));
            }
        };
        // Stores of hubs from before tenancy join the model first: the
        // first-start admin token then lands in an existing `default`.
        crate::tenancy::migrate(&*store)?;
        tokens::migrate_api_tokens(&*store, &config.admin_group)?;
        let admin_token = tokens::ensure_admin_token(&*store, &config.data_dir)?;
        let pruned = tokens::prune_join_tokens(&*store)?;
        if pruned > 0 {
            tracing::info!(pruned, "removed long-expired join tokens");
        }

        // The tunnel port first: an agent that finds the API port taking
        // connections (after a restart) takes the tunnel port to be up too,
        // not moved.
        let (tunnel_tcp, endpoint_udp) = bind_tunnel_port(config.tunnel_listen).await?;
        let tunnel_addr = tunnel_tcp.local_addr()?;
        let api = bind_tcp(config.api_listen).await?;
        let api_addr = api.local_addr()?;

        let external_url = config.external_url(api_addr.port());
        let tunnel_urls = config.tunnel_urls(tunnel_addr.port());
        let names =
            authority::server_names(std::iter::once(&external_url).chain(tunnel_urls.iter()));
        let authority = authority::Authority::load(&*store, names, config.data_dir.clone())?;
        // The listeners' certificate and trusted CAs follow the authority,
        // so a CA rotation needs no restart.
        let live = authority.live_tls();
        // A certificate from files, when given, on the API port only: the
        // tunnel and peer ports stay pinned to the hub CA.
        let api_cert = match &config.api_tls {
            Some(files) => Some(
                otter_pki::live::FileCert::load(&files.cert_file, &files.key_file)
                    .map_err(|e| HubError::Config(format!("--tls-cert-file: {e}")))?,
            ),
            None => None,
        };
        let api_alpn: &[&[u8]] = &[b"h2", b"http/1.1"];
        let api_tls = match &api_cert {
            Some(cert) => {
                live.server_config_presenting(tls::ClientAuth::Optional, api_alpn, cert.clone())?
            }
            None => live.server_config(tls::ClientAuth::Optional, api_alpn)?,
        };
        let mut tunnel_tls = live.server_config(
            tls::ClientAuth::Required,
            &[h2::ALPN, otter_tunnel::ws::ALPN, h2::LINK_ALPN],
        )?;
        let mut quic_tls = live.server_config(tls::ClientAuth::Required, &[quic::ALPN])?;
        // Agents coming back resume their sessions, on keys every replica
        // and every restart reads from the store.
        let tickets = crate::tickets::Tickets::default();
        if let Err(e) = tickets.roll(&*store) {
            tracing::warn!(error = %e, "no TLS ticket keys: agents make full handshakes");
        }
        tunnel_tls.ticketer = tickets.tcp.clone();
        quic_tls.ticketer = tickets.quic.clone();
        // A client spends a ticket on every try, and a QUIC try spends it
        // even when nothing answers (a hub restarting): a few in hand
        // outlast a few failed rounds.
        tunnel_tls.send_tls13_tickets = crate::tickets::TICKETS_PER_HANDSHAKE;
        quic_tls.send_tls13_tickets = crate::tickets::TICKETS_PER_HANDSHAKE;
        // Replicas reach each other on a port of their own, each showing a
        // replica certificate from the shared CA.
        let peer_port = match config.peer_listen {
            Some(addr) => {
                let listener = bind_tcp(addr).await?;
                let tls = live.server_config(tls::ClientAuth::Required, &[b"h2"])?;
                Some((listener, Arc::new(tls)))
            }
            None => None,
        };
        if let Some((listener, _)) = &peer_port {
            let addr = listener.local_addr()?;
            config.peer_url.get_or_insert_with(|| {
                let host = if addr.ip().is_loopback() || addr.ip().is_unspecified() {
                    "localhost".to_owned()
                } else {
                    addr.ip().to_string()
                };
                format!("https://{host}:{}", addr.port())
                    .parse()
                    .expect("a URL from an address")
            });
        }
        let peers = match &peer_port {
            Some(_) => Some(crate::peers::Peers::new(&authority, &config.replica)?),
            None => None,
        };

        let quic_settings = quic::QuicSettings {
            keepalive: config.keepalive,
            ..Default::default()
        };
        let h2_settings = h2::H2Settings {
            keepalive: config.keepalive,
            ..Default::default()
        };
        // Reuses the UDP socket reserved alongside the TCP port.
        let endpoint = quic::hub_endpoint_on(
            endpoint_udp,
            quic_tls,
            &quic_settings,
            &quic_reset_secret(&*store)?,
        )?;
        let quic_port = endpoint.local_addr()?.port();

        let methods = Methods::load_with(
            otter_proto::FILE_DESCRIPTOR_SET,
            &[
                tonic_health::pb::FILE_DESCRIPTOR_SET,
                tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
            ],
            &config.disabled_features,
        )?;
        let oidc = config.oidc.clone().map(OidcVerifier::new).transpose()?;
        let manifest_key = crate::manifest::url_key(&*store)?;
        let rancher = match &config.rancher_kubeconfig {
            Some(path) => Some(crate::rancher::Rancher::from_kubeconfig(path).await?),
            None => None,
        };
        let charts = Arc::new(crate::chart::Charts::new(config.charts.clone())?);
        let (health, health_service) = tonic_health::server::health_reporter();
        let tasks = TaskTracker::new();
        let pacer = otter_tunnel::pace::Pacer::with_handshakes(
            config.max_concurrent_admissions,
            config.admission_retry_after,
            config.tunnel_handshakes,
        );
        // The API port may take at most half the descriptors: the rest
        // keeps the tunnel port (and the store) working under a flood.
        let mut api_limits = config.api_connections;
        if let Some(n) = open_files {
            api_limits.max_total = api_limits
                .max_total
                .min(usize::try_from(n / 2).unwrap_or(usize::MAX));
        }
        let api_pending = otter_tunnel::handshakes::Handshakes::new(config.api_handshakes);
        let register_pacer = otter_tunnel::pace::Pacer::new(
            config.max_concurrent_registrations,
            config.admission_retry_after,
        );
        let metrics = Arc::new(Metrics::default());
        metrics.watch_quic_socket(quic_port);
        let audit = match &config.audit_log {
            Some(target) => crate::audit::Audit::start(target.clone(), metrics.clone())?,
            None => crate::audit::Audit::off(metrics.clone()),
        };
        let registry = Registry::new(config.max_calls_per_tenant);
        let state = Arc::new(HubState {
            config,
            store,
            authority,
            registry,
            external_url,
            tunnel_urls,
            tasks: tasks.clone(),
            methods,
            oidc,
            health,
            metrics,
            audit,
            manifest_key,
            rancher,
            pacer: pacer.clone(),
            register_pacer,
            upgrades: Arc::default(),
            api_connections: crate::limits::ApiConnections::new(api_limits),
            live: Arc::default(),
            peers,
            renewals: Default::default(),
            charts,
            serving: Default::default(),
            store_writable: std::sync::atomic::AtomicBool::new(true),
            tickets,
            fan_outs: Default::default(),
            uploads: Default::default(),
            last_seen: Default::default(),
            claims: Default::default(),
            links: Default::default(),
            api_pending,
        });
        let shutdown = CancellationToken::new();
        let intake = shutdown.child_token();
        let (accepted_tx, accepted_rx) = mpsc::channel(256);
        tasks.spawn(crate::tunnels::run(
            state.clone(),
            accepted_rx,
            intake.clone(),
        ));
        tasks.spawn(crate::tunnels::watch_liveness(
            state.clone(),
            shutdown.clone(),
        ));
        let (links_tx, links_rx) = mpsc::channel(16);
        tasks.spawn(h2::accept_loop_paced(
            tunnel_tcp,
            Arc::new(tunnel_tls),
            h2_settings,
            accepted_tx.clone(),
            Some(links_tx),
            shutdown.clone(),
            pacer.clone(),
        ));
        tasks.spawn(quic::accept_loop_paced(
            endpoint,
            accepted_tx,
            shutdown.clone(),
            pacer,
            quic::place_wait(&quic_settings),
        ));
        let ops_listeners =
            crate::ops::bind(state.config.metrics_listen, state.config.health_listen).await?;
        let health_routes = tonic::service::Routes::new(health_service.clone());
        let routes = api_routes(&state, health_service)?;
        let api_tls = (!state.config.api_plaintext).then(|| Arc::new(api_tls));
        tasks.spawn(serve_tunnel_port_links(
            state.clone(),
            routes.clone(),
            links_rx,
            shutdown.clone(),
        ));
        tasks.spawn(serve_api(
            state.clone(),
            routes,
            api,
            api_tls,
            shutdown.clone(),
        ));
        let mut ops_addrs = Vec::new();
        for (listener, roles) in ops_listeners {
            let addr = listener.local_addr()?;
            tracing::info!(%addr, metrics = roles.metrics, health = roles.health, "ops port listening");
            ops_addrs.push((addr, roles));
            tasks.spawn(crate::ops::serve(
                state.clone(),
                listener,
                roles,
                health_routes.clone(),
                shutdown.clone(),
            ));
        }
        if let Some((listener, tls)) = peer_port {
            tracing::info!(addr = %listener.local_addr()?, replica = %state.config.replica, "peer port listening");
            tasks.spawn(crate::peers::serve(
                state.clone(),
                listener,
                tls,
                shutdown.clone(),
            ));
        }
        if state.config.peer_url.is_some() {
            tasks.spawn(crate::peers::write_claims(state.clone(), shutdown.clone()));
        }
        if state.config.store.is_some() {
            tasks.spawn(follow_cas(state.clone(), shutdown.clone()));
            crate::peers::announce(&state);
            tasks.spawn(crate::peers::check_local_tunnels(
                state.clone(),
                shutdown.clone(),
            ));
        }
        if let (Some(cert), Some(files)) = (api_cert, &state.config.api_tls) {
            tasks.spawn(reload_api_cert(cert, files.reload_every, shutdown.clone()));
        }
        tasks.spawn(watch_health(state.clone(), shutdown.clone()));
        let stop_writer = CancellationToken::new();
        let last_seen_writer = (
            stop_writer.clone(),
            tokio::spawn(crate::tunnels::write_last_seen(state.clone(), stop_writer)),
        );
        tasks.spawn(prune_periodically(state.clone(), shutdown.clone()));
        tasks.spawn(crate::tickets::roll_periodically(
            state.clone(),
            shutdown.clone(),
        ));
        tasks.spawn(crate::credentials::sweep_every(
            state.live.clone(),
            state.store.clone(),
            state.config.recheck_tokens_every,
            shutdown.clone(),
        ));
        state
            .serving
            .store(true, std::sync::atomic::Ordering::Release);
        tracing::info!(%api_addr, %tunnel_addr, external_url = %state.external_url, "hub serving");
        Ok(Hub {
            initial_ca_pem: state.authority.current().active.cert_pem().to_owned(),
            state,
            api_addr,
            tunnel_addr,
            admin_token,
            ops_addrs,
            shutdown,
            intake,
            last_seen_writer,
        })
    }

    /// The CA certificate agents and clients trust: the one this hub
    /// started with (see [`Hub::ca_bundle`] during a rotation).
    pub fn ca_pem(&self) -> &str {
        &self.initial_ca_pem
    }

    /// Every CA the hub trusts right now, the active one first.
    pub fn ca_bundle(&self) -> String {
        self.state.authority.current().bundle_pem()
    }

    /// Mints a join token for `cluster` of tenant `default` with the
    /// configured lifetime.
    pub fn mint_join_token(&self, cluster: &str) -> Result<String> {
        self.mint_join_token_in(cluster, crate::tenancy::DEFAULT_TENANT)
    }

    /// Mints a join token for `cluster` of `tenant`, claiming the name for
    /// it as a manifest does.
    pub fn mint_join_token_in(&self, cluster: &str, tenant: &str) -> Result<String> {
        crate::tenancy::claim_cluster(&*self.state.store, cluster, tenant)?
            .map_err(|e| crate::HubError::Config(e.to_string()))?;
        tokens::mint_join_token(
            &*self.state.store,
            cluster,
            tenant,
            self.state.config.join_token_ttl,
        )
    }

    /// Lets an enrolled cluster take a new agent (see
    /// [`crate::link_service::open_for_reenrollment`]); false when it has
    /// no link.
    pub fn re_enroll(&self, cluster: &str) -> Result<bool> {
        Ok(crate::link_service::open_for_reenrollment(&*self.state.store, cluster)?.is_some())
    }

    /// Mints an API token for a member of tenant `default`.
    pub fn mint_api_token(&self, user: &str, groups: &[String]) -> Result<String> {
        let spec = tokens::TokenSpec::member(user, groups, crate::tenancy::DEFAULT_TENANT);
        Ok(tokens::mint_api_token(&*self.state.store, &spec)?.0)
    }

    /// Mints an API token as described.
    pub fn mint_token(&self, spec: &tokens::TokenSpec) -> Result<String> {
        Ok(tokens::mint_api_token(&*self.state.store, spec)?.0)
    }

    /// Creates a tenant.
    pub fn create_tenant(&self, name: &str) -> Result<()> {
        crate::tenancy::validate_tenant_name(name)?;
        crate::tenancy::create_tenant(&*self.state.store, name, "hub")?
            .map_err(|e| crate::HubError::Config(e.to_string()))?;
        Ok(())
    }

    /// Stops every listener, closes every tunnel, and waits (bounded) for all
    /// tasks, so the store is released when this returns.
    pub async fn shutdown(self) {
        self.state
            .serving
            .store(false, std::sync::atomic::Ordering::Release);
        self.intake.cancel();
        let tunnels = self.state.registry.all();
        let step = std::time::Instant::now();
        // The goodbye sends the agents to the other live replicas.
        let others: Vec<url::Url> = crate::peers::tunnel_urls_for_agents(&self.state)
            .into_iter()
            .filter(|u| !self.state.tunnel_urls.contains(u))
            .collect();
        let others: Vec<&str> = others.iter().map(url::Url::as_str).collect();
        let bye = otter_tunnel::frame::stopping_reason(&others, otter_tunnel::http::MAX_REASON);
        // Goodbyes that need the agent's answer (HTTP/2, WebSocket) go out
        // first, together: a stop waits at most one goodbye's bound. Only
        // then are the QUIC tunnels closed, whose goodbye is the close
        // itself (it names the reason in a frame only the hub can send; a
        // goodbye on a stream would only open one that the close then
        // cuts), and before the endpoint (below), whose own close names no
        // other replica. The other way round, the QUIC agents' handshakes
        // with the other replicas took the CPU the answers needed: in the
        // bench's rolling restart (10,000 tunnels, half over each, agents
        // and replicas on one machine) 200-230 of the 5,000 over HTTP/2
        // took their goodbye, and those that knew no other replica yet
        // came back up to 38.8 s later. In this order, 4,320-4,960 did.
        let bye = bye.as_str();
        futures::future::join_all(
            tunnels
                .iter()
                .filter(|t| t.opener.kind() != otter_tunnel::TransportKind::Quic)
                .map(|t| crate::registry::close_with_goodbye(t, bye)),
        )
        .await;
        // Every tunnel still in the table: the QUIC ones, and one the intake
        // was admitting as it stopped, whose task would otherwise wait for
        // a close that never comes (closing a closed tunnel again keeps
        // its first reason).
        for t in self.state.registry.all() {
            t.opener.close(bye);
        }
        self.shutdown.cancel();
        self.state.uploads.stop();
        slow_step(step, "saying goodbye on every tunnel");
        let step = std::time::Instant::now();
        for t in tunnels {
            crate::peers::release(&self.state, &t.cluster, t.id);
            // Recorded here, not only by the tunnel's own task: that task
            // records a close only while its tunnel is still in the routing
            // table, which is emptied below, maybe before it runs.
            crate::tunnels::touch(&self.state, &t.cluster, "");
        }
        // Many to a transaction; what etcd has not taken within the bound
        // goes with this replica's lease.
        crate::peers::write_records_now(&self.state, Duration::from_secs(5)).await;
        slow_step(step, "clearing the tunnels' records");
        if self.state.config.store.is_some()
            && let Err(e) = self
                .state
                .store
                .delete(crate::store::tree::REPLICAS, &self.state.config.replica)
        {
            tracing::warn!(error = %e, "could not remove this replica from the list");
        }
        // The routing table holds the tunnels' connections, and a QUIC
        // connection holds the endpoint's socket: drop them now rather than
        // with the last reference to the state, so the port is free when
        // this returns.
        self.state.registry.clear();
        self.state.tasks.close();
        // Each step of the stop that takes long says so, with what it waited
        // for: a stop is normally over in a second or two.
        let step = std::time::Instant::now();
        if tokio::time::timeout(Duration::from_secs(10), self.state.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.state.tasks.len(),
                "hub tasks did not stop within 10 s"
            );
        }
        // The tunnels, all closed now, recorded when they were last seen:
        // written while they closed, the rest now.
        let (stop_writer, writer) = self.last_seen_writer;
        stop_writer.cancel();
        let _ = writer.await;
        let _ = self.state.store.flush();
        slow_step(step, "writing the links' last-seen times");
        // Connection tasks the HTTP server spawned for in-flight streams may
        // still hold the state (and with it the store's file lock) for a
        // moment; wait, bounded, until this is the last reference, so a hub
        // started right after on the same data dir can open it.
        let step = std::time::Instant::now();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&self.state) > 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if Arc::strong_count(&self.state) > 1 {
            tracing::warn!(
                holders = Arc::strong_count(&self.state) - 1,
                "connection tasks still hold the hub's state after 5 s"
            );
        } else {
            slow_step(
                step,
                "waiting for connection tasks to let go of the hub's state",
            );
        }
    }
}

/// Logs a step of the stop that took over 2 s.
fn slow_step(started: std::time::Instant, what: &str) {
    let took = started.elapsed();
    if took > Duration::from_secs(2) {
        tracing::warn!(
            took_ms = took.as_millis() as u64,
            "stopping: {what} was slow"
        );
    }
}

/// The QUIC stateless-reset secret, made once and kept in the store.
fn quic_reset_secret(store: &dyn Store) -> Result<Vec<u8>> {
    crate::store::secret(store, "quic-reset-key")
}

/// Opens the store, waiting (bounded) while a previous hub of this process
/// still releases its lock; another process holding it is an error at once
/// after that.
async fn open_store(dir: &std::path::Path) -> Result<SledStore> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match SledStore::open(dir) {
            Ok(store) => return Ok(store),
            Err(HubError::Locked(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Binds TCP and UDP on the same port. With port 0 the kernel picks the TCP
/// port; if that UDP port is taken, try again.
///
/// A fixed port still held by the QUIC endpoint of a hub that just stopped
/// (its closing connections drain for a moment) is waited for, bounded,
/// so a restart right after a stop finds its port again.
async fn bind_tunnel_port(addr: SocketAddr) -> Result<(TcpListener, std::net::UdpSocket)> {
    // Closing connections hold the socket for three probe timeouts, which
    // a loaded machine has seen reach about 13 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut fresh_ports = 0;
    // Bounded: 16 fresh ports, or the deadline for a fixed one.
    let last_err = loop {
        let tcp = bind_tcp(addr).await?;
        let port = tcp.local_addr()?.port();
        match std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), port)) {
            Ok(udp) => return Ok((tcp, udp)),
            Err(e) if addr.port() == 0 => {
                fresh_ports += 1;
                if fresh_ports >= 16 {
                    break e;
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                drop(tcp);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                let at = SocketAddr::new(addr.ip(), port);
                return Err(std::io::Error::new(e.kind(), format!("UDP {at}: {e}")).into());
            }
        }
    };
    Err(HubError::from(last_err))
}

/// Connections the kernel holds for a listener before it accepts them.
/// Tokio's default (1,024) is less than the agents that come back together
/// after a restart: past it the kernel drops their SYNs, and each waits out
/// TCP's retransmission (1, 3, 7, 15 s) while the hub is idle. The kernel
/// caps this at its `somaxconn` (4,096 on current kernels), as Go's
/// listeners ask for.
const LISTEN_BACKLOG: u32 = 65_535;

/// A TCP listener on `addr` with [`LISTEN_BACKLOG`].
fn listen_tcp(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restart may bind while connections of
    // the old process are still in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Binds a TCP listener; a fixed port still held by a hub of this process
/// that is just stopping is waited for, bounded (a new process would find
/// it free; one restarting in place must wait for the old listener to go).
async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match listen_tcp(addr) {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && addr.port() != 0
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("TCP {addr}: {e}")).into()),
            Ok(l) => return Ok(l),
        }
    }
}

/// A client certificate the TLS layer handed over, if it holds now: a
/// resumed session carries the certificate of the handshake it resumes
/// without verifying it again (an expired one, or one of a CA retired
/// since), so every connection's certificate is checked here as a full
/// handshake would check it. A certificate that fails is as none.
fn verified_peer(
    state: &HubState,
    der: Option<&rustls::pki_types::CertificateDer<'_>>,
) -> Option<Vec<u8>> {
    let der = der?;
    match state.authority.live_tls().verify_client(der) {
        Ok(()) => Some(der.to_vec()),
        Err(e) => {
            tracing::debug!(error = %e, "a client certificate that no longer holds was ignored");
            None
        }
    }
}

/// The gRPC services the hub itself implements (the forwarded services
/// are routed before these).
fn api_routes(
    state: &Arc<HubState>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
) -> Result<tonic::service::Routes> {
    let reflection_sets = [
        otter_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ];
    let mut v1 = tonic_reflection::server::Builder::configure();
    let mut v1alpha = tonic_reflection::server::Builder::configure();
    for set in reflection_sets {
        v1 = v1.register_encoded_file_descriptor_set(set);
        v1alpha = v1alpha.register_encoded_file_descriptor_set(set);
    }
    // Reflection lists what this hub serves: a switched-off feature's
    // service is left out (its types stay resolvable by name).
    let listed = SERVICES
        .into_iter()
        .chain(["grpc.health.v1.Health"])
        .filter(|s| !state.methods.service_disabled(s));
    for service in listed {
        v1 = v1.with_service_name(service);
        v1alpha = v1alpha.with_service_name(service);
    }
    let v1 = v1
        .build_v1()
        .map_err(|e| HubError::Config(format!("reflection: {e}")))?;
    let v1alpha = v1alpha
        .build_v1alpha()
        .map_err(|e| HubError::Config(format!("reflection: {e}")))?;
    Ok(tonic::service::Routes::new(LinkServiceServer::new(LinkSvc {
        state: state.clone(),
    }))
    .add_service(FleetServiceServer::new(crate::fleet::FleetSvc {
        state: state.clone(),
    }))
    .add_service(health)
    .add_service(v1)
    .add_service(v1alpha))
}

/// Removes expired join tokens and manifest-URL counts every ten minutes,
/// so fetching manifest URLs cannot grow the store without bound between
/// restarts.
async fn prune_periodically(state: Arc<HubState>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(600));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        match tokens::prune_join_tokens(&*state.store) {
            Ok(0) => {}
            Ok(pruned) => tracing::info!(
                pruned,
                "removed expired join tokens and manifest URL counts"
            ),
            Err(e) => tracing::warn!(error = %e, "pruning expired join tokens failed"),
        }
    }
}

/// The OtterScale services, as health and reflection name them.
const SERVICES: [&str; 4] = [
    "otterscale.link.v1.LinkService",
    "otterlink.fleet.v1.FleetService",
    "otterscale.resource.v1.ResourceService",
    "otterscale.runtime.v1.RuntimeService",
];

/// Keeps the health status in step with the store: SERVING only while
/// writes succeed (listeners are bound before this starts). The probe
/// write blocks (an etcd store waits up to a second for it), so it runs
/// off the async workers.
/// Reads the API certificate's files again when they change (cert-manager
/// rewrites them before expiry): handshakes from then on show the new one.
async fn reload_api_cert(
    cert: Arc<otter_pki::live::FileCert>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let c = cert.clone();
        match tokio::task::spawn_blocking(move || c.reload_if_changed()).await {
            Ok(Ok(true)) => tracing::info!("read the API certificate's files again"),
            Ok(Ok(false)) | Err(_) => {}
            // Half-written files are read again on the next tick.
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not read the API certificate again; keeping the current one")
            }
        }
    }
}

/// Keeps this replica's CAs what the shared store says: a rotation step
/// taken on another replica is taken up here within the store's watch
/// (milliseconds), and at the latest after [`FOLLOW_CAS_EVERY`].
async fn follow_cas(state: Arc<HubState>, shutdown: CancellationToken) {
    let mut follower =
        crate::store::Follower::new(&*state.store, Duration::from_millis(100), FOLLOW_CAS_EVERY);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = follower.next() => {}
        }
        if let Err(e) = state.authority.follow(&*state.store) {
            tracing::warn!(error = %e, "could not take up the store's CAs");
        }
        crate::admin::cas_changed(&state);
    }
}

/// How often a replica looks for a CA step taken elsewhere when the
/// store's watch says nothing.
const FOLLOW_CAS_EVERY: Duration = Duration::from_secs(5);

async fn watch_health(state: Arc<HubState>, shutdown: CancellationToken) {
    let mut last = None;
    loop {
        let probing = state.clone();
        let ok = tokio::task::spawn_blocking(move || probing.store.writable())
            .await
            .unwrap_or(false);
        state
            .store_writable
            .store(ok, std::sync::atomic::Ordering::Release);
        if last != Some(ok) {
            let status = |serving: bool| {
                if serving {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                }
            };
            state.health.set_service_status("", status(ok)).await;
            // A service whose feature is switched off says so, the way a
            // load balancer or a dashboard expects to find out.
            for service in SERVICES {
                let serving = ok && !state.methods.service_disabled(service);
                state
                    .health
                    .set_service_status(service, status(serving))
                    .await;
            }
            if !ok {
                tracing::error!("store is not writable; health is NOT_SERVING");
            }
            last = Some(ok);
        }
        tokio::select! {
            _ = tokio::time::sleep(HEALTH_EVERY) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// How often the store's writability is probed for health and readiness.
/// Each probe is a write: on etcd, the idle cost of a replica (0.2 writes
/// a second), whatever the number of agents.
const HEALTH_EVERY: Duration = Duration::from_secs(5);

/// Accepts API connections; each handshake and connection runs in its own
/// task. Without TLS (local development) HTTP/1.1 and h2c are served.
///
/// Until it has sent a whole request head a connection is anyone's: it
/// holds a place among the pending ones ([`HubState::api_pending`]), and
/// is closed if it has not sent that head within
/// [`crate::limits::FIRST_REQUEST_TIMEOUT`] of being accepted (TLS
/// handshake included). A connection over the global or its source's cap
/// ([`HubState::api_connections`]) is closed at once.
async fn serve_api(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: CancellationToken,
) {
    let acceptor = tls.map(TlsAcceptor::from);
    loop {
        let (tcp, remote) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "API accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let pending = tokio::select! {
            p = state.api_pending.begin(remote.ip()) => p,
            _ = shutdown.cancelled() => return,
        };
        let Some(pending) = pending else {
            tracing::debug!(%remote, "API connection refused: its source holds too many pending connections");
            continue;
        };
        let Some(place) = state.api_connections.try_enter(remote.ip()) else {
            tracing::debug!(%remote, "API connection refused: over the connection cap");
            continue;
        };
        let (acceptor, routes, state2, shutdown) = (
            acceptor.clone(),
            routes.clone(),
            state.clone(),
            shutdown.clone(),
        );
        state.tasks.spawn(async move {
            let _place = place;
            let evicted = pending.evicted();
            let _ = tcp.set_nodelay(true);
            probe_when_silent(&tcp, state2.config.api_keepalive);
            // Not dropped for a newcomer while its bytes wait for the hub.
            let tcp = pending.watch(tcp);
            let first = FirstRequest {
                accepted: tokio::time::Instant::now(),
                pending: Arc::new(std::sync::Mutex::new(Some(pending))),
            };
            let serve = async move {
            match acceptor {
                Some(acceptor) => {
                    let tls = match tokio::time::timeout(
                        API_HANDSHAKE_TIMEOUT.min(crate::limits::FIRST_REQUEST_TIMEOUT),
                        acceptor.accept(tcp),
                    )
                    .await
                    {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            return tracing::debug!(%remote, error = %e, "API TLS handshake failed");
                        }
                        Err(_) => return tracing::debug!(%remote, "API TLS handshake timed out"),
                    };
                    let peer_cert = verified_peer(
                        &state2,
                        tls.get_ref().1.peer_certificates().and_then(|c| c.first()),
                    );
                    let conn = Arc::new(ConnInfo {
                        remote,
                        peer_cert,
                        tunnel_port: false,
                    });
                    serve_connection(state2, routes, conn, TokioIo::new(tls), first, shutdown)
                        .await;
                }
                None => {
                    let conn = Arc::new(ConnInfo {
                        remote,
                        peer_cert: None,
                        tunnel_port: false,
                    });
                    serve_connection(state2, routes, conn, TokioIo::new(tcp), first, shutdown)
                        .await;
                }
            }
            };
            tokio::select! {
                () = serve => {}
                _ = evicted.cancelled() => tracing::debug!(%remote, "API connection dropped for a newer one: no request head yet"),
            }
        });
    }
}

/// Renewal connections on the tunnel port served at once; one more is
/// closed, and its agent renews on the API port.
const TUNNEL_PORT_LINKS_AT_ONCE: usize = 64;

/// How long a renewal connection on the tunnel port may stay: one
/// Register, with room for a slow link.
const TUNNEL_PORT_LINK_LIFETIME: Duration = Duration::from_secs(30);

/// Serves the link API to agents renewing on the tunnel port (TLS, with a
/// verified client certificate, done by the tunnel listener). Only
/// Register with that certificate is answered there ([`route`],
/// [`crate::link_service`]): the tunnel port stays closed to everything
/// a user or an unenrolled agent calls.
async fn serve_tunnel_port_links(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    mut links: mpsc::Receiver<otter_tunnel::transport::LinkConn>,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(TUNNEL_PORT_LINKS_AT_ONCE));
    loop {
        let link = tokio::select! {
            l = links.recv() => match l { Some(l) => l, None => return },
            _ = shutdown.cancelled() => return,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(remote = %link.remote, "renewal connection on the tunnel port closed: too many at once");
            continue;
        };
        let conn = Arc::new(ConnInfo {
            remote: link.remote,
            peer_cert: verified_peer(&state, link.peer_cert.as_ref()),
            tunnel_port: true,
        });
        let first = FirstRequest {
            accepted: tokio::time::Instant::now(),
            pending: Arc::default(),
        };
        let serve = serve_connection(
            state.clone(),
            routes.clone(),
            conn,
            TokioIo::new(link.io),
            first,
            shutdown.clone(),
        );
        state.tasks.spawn(async move {
            let _slot = slot;
            let _ = tokio::time::timeout(TUNNEL_PORT_LINK_LIFETIME, serve).await;
        });
    }
}

/// A connection's way to its first request head: when it was accepted,
/// and its place among the pending connections until the head arrives.
struct FirstRequest {
    accepted: tokio::time::Instant,
    pending: Arc<std::sync::Mutex<Option<otter_tunnel::handshakes::Handshake>>>,
}

impl FirstRequest {
    /// The head arrived: the pending place frees, and the deadline and
    /// eviction no longer apply.
    fn arrived(&self) {
        if let Some(p) = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            p.verified();
        }
    }

    fn waiting(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }
}

/// The kernel's side of a caller's liveness, for HTTP/1.1 (which has no
/// ping) and for a peer that is gone altogether: after `keepalive.interval`
/// of silence TCP probes, and three unanswered probes over
/// `keepalive.timeout` reset the connection.
fn probe_when_silent(tcp: &tokio::net::TcpStream, keepalive: otter_tunnel::Keepalive) {
    const PROBES: u32 = 3;
    let between = (keepalive.timeout / PROBES).max(Duration::from_secs(1));
    let probes = socket2::TcpKeepalive::new()
        .with_time(keepalive.interval)
        .with_interval(between)
        .with_retries(PROBES);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&probes) {
        tracing::debug!(error = %e, "TCP keepalive not set on an API connection");
    }
}

async fn serve_connection<I>(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    conn: Arc<ConnInfo>,
    io: I,
    first: FirstRequest,
    shutdown: CancellationToken,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let remote = conn.remote;
    let keepalive = state.config.api_keepalive;
    let first = Arc::new(first);
    let service = {
        let first = first.clone();
        hyper::service::service_fn(move |req| {
            first.arrived();
            dispatch(state.clone(), routes.clone(), conn.clone(), req)
        })
    };
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_header_list_size(64 * 1024)
        .max_concurrent_streams(1000)
        // What the hub holds of one answer for a caller that reads slower
        // than the cluster sends (hyper's default is 400 KiB): beyond it the
        // answer waits in the tunnel, under its flow control. A caller may
        // grant any window and then stop reading, so this times the calls
        // it may open is what it can make the hub hold.
        .max_send_buf_size(API_SEND_BUFFER)
        // hyper pings once the caller has sent nothing for the interval,
        // and ends the connection (and every call on it) without an answer.
        .keep_alive_interval(keepalive.interval)
        .keep_alive_timeout(keepalive.timeout);
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(crate::limits::HEADER_READ_TIMEOUT)
        .max_buf_size(64 * 1024);
    let serving = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(serving);
    // Only a connection that has not yet sent a whole request head is cut;
    // after that the deadline never fires.
    let silent = async {
        tokio::time::sleep_until(first.accepted + crate::limits::FIRST_REQUEST_TIMEOUT).await;
        if !first.waiting() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = serving.as_mut() => if let Err(e) = r { tracing::debug!(%remote, error = %e, "API connection ended") },
        _ = silent => tracing::debug!(%remote, "API connection closed: no request head in time"),
        _ = shutdown.cancelled() => {}
    }
}

async fn dispatch(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    conn: Arc<ConnInfo>,
    req: http::Request<Incoming>,
) -> std::result::Result<http::Response<HttpBody>, Infallible> {
    let origins = &state.config.cors_origins;
    if let Some(preflight) = cors::preflight(origins, &req) {
        return Ok(preflight);
    }
    let origin = req.headers().get(http::header::ORIGIN).cloned();
    let resp = route(state.clone(), routes, conn, req).await;
    Ok(cors::decorate(resp, origin, &state.config.cors_origins))
}

pub(crate) fn plain(status: http::StatusCode, text: &str) -> http::Response<HttpBody> {
    let mut resp = http::Response::new(
        Full::new(Bytes::from(format!("{text}\n")))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Picks the handler for a request and the protocol it speaks.
async fn route(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    conn: Arc<ConnInfo>,
    mut req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let path = req.uri().path().to_owned();
    if conn.tunnel_port && path != crate::link_service::REGISTER_PATH {
        // Every caller here is an agent speaking gRPC: a gRPC refusal.
        return unread_body(
            tonic::Status::permission_denied(format!(
                "the tunnel port serves {} (renewal) and nothing else; call {path} on the API port",
                crate::link_service::REGISTER_PATH
            ))
            .into_http(),
            req,
        );
    }
    req.extensions_mut().insert(conn);
    if req.method() == http::Method::GET
        && let Some(resp) = crate::ops::probe(&state, &path)
    {
        return resp;
    }
    // The manifest URL is its own credential.
    if let Some(token) = path.strip_prefix("/link/manifest/") {
        if req.method() != http::Method::GET {
            return unread_body(plain(http::StatusCode::METHOD_NOT_ALLOWED, "use GET"), req);
        }
        return match crate::link_service::manifest_from_url(&state, token) {
            Ok(yaml) => {
                let mut resp = plain(http::StatusCode::OK, yaml.trim_end());
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/yaml; charset=utf-8"),
                );
                resp.headers_mut().insert(
                    http::header::CACHE_CONTROL,
                    http::HeaderValue::from_static("no-store"),
                );
                resp
            }
            Err((status, text)) => plain(status, &text),
        };
    }
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or(path.clone(), |p| p.as_str().to_owned());
    // What the request is for: it decides the shape of a refusal.
    let endpoint = if let Some((cluster, tail)) =
        crate::kube_proxy::split(&state.config.kube_proxy_prefix, &path_and_query)
    {
        Endpoint::Kube {
            cluster: cluster.to_owned(),
            tail: tail.to_owned(),
        }
    } else if path == "/metrics" && req.method() == http::Method::GET {
        Endpoint::Metrics
    } else if path.starts_with("/admin/v1/") {
        Endpoint::Admin
    } else {
        let Some(method) = state.methods.get(&path).cloned() else {
            return unread_body(
                plain(
                    http::StatusCode::NOT_FOUND,
                    &format!("no such endpoint: {path}"),
                ),
                req,
            );
        };
        match protocol::detect(req.method(), req.headers()) {
            Ok(proto) => Endpoint::Api { method, proto },
            Err(why) => return unread_body(protocol::unsupported_response(&why), req),
        }
    };
    // The one authentication: who is calling is decided here, from the
    // headers, before a byte of the body is read, for every endpoint but
    // the API methods anyone may call (`auth::needs_token`). The handlers
    // behind take the caller from the request's extensions.
    let public = matches!(endpoint, Endpoint::Api { .. }) && !crate::auth::needs_token(&path);
    if !public {
        match crate::auth::authenticate(&state, req.headers()).await {
            Ok(caller) => {
                req.extensions_mut().insert(crate::auth::Verified(caller));
            }
            Err(status) => return unread_body(endpoint.refusal(&status), req),
        }
    }
    let (method, proto) = match endpoint {
        Endpoint::Kube { cluster, tail } => {
            return crate::kube_proxy::handle(state, cluster, tail, req).await;
        }
        Endpoint::Metrics => {
            return match crate::auth::verified(req.extensions())
                .and_then(|c| crate::auth::require_operator(&c))
            {
                Ok(()) => crate::ops::metrics(&state),
                Err(status) => {
                    unread_body(plain(http::StatusCode::FORBIDDEN, status.message()), req)
                }
            };
        }
        Endpoint::Admin => return crate::admin::route(state, &path, req).await,
        Endpoint::Api { method, proto } => (method, proto),
    };
    // Only the endpoints that need no token take a body from an anonymous
    // client, and a small one.
    let max = if public {
        crate::limits::MAX_PUBLIC_MESSAGE
    } else {
        state.config.max_request_message
    };
    // After authentication: which features this hub serves is for its
    // users to learn, not for anyone with a socket.
    if let Err(status) = state.methods.check_enabled(&path) {
        return unread_body(protocol_error(proto, &status), req);
    }
    let inner = GrpcHandler {
        state: state.clone(),
        routes: routes.clone(),
    };
    let version = req.version();
    let req = req.map(|body| crate::limits::RequestBody::new(body, version));
    match proto {
        Protocol::Grpc { json } => {
            let req = req.map(|b| {
                b.map_err(|e| -> protocol::BoxError { Box::new(e) })
                    .boxed_unsync()
            });
            if !json {
                return grpc_call(state, routes, req).await;
            }
            let owner = protocol::owner_of(req.extensions());
            let req = protocol::transcode::json_request(req, method.input.clone(), max);
            let resp = grpc_call(state, routes, req).await;
            let mut resp = protocol::transcode::json_response(resp, method.output.clone(), owner);
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc+json"),
            );
            resp
        }
        Protocol::GrpcWeb { text, json } => {
            let json = json.then_some((&method, max));
            protocol::grpc_web::call(inner, text, json, req).await
        }
        Protocol::ConnectUnary { json } => {
            protocol::connect::unary(inner, method, json, req, max).await
        }
        Protocol::ConnectGet => protocol::connect::unary(inner, method, true, req, max).await,
        Protocol::ConnectStream { json } => {
            protocol::connect::streaming(inner, method, json, req, max).await
        }
    }
}

/// What a request is for, from its method and path.
enum Endpoint {
    /// kubectl through the hub: `/clusters/<name>/…`.
    Kube { cluster: String, tail: String },
    /// Prometheus text, for operators.
    Metrics,
    /// `/admin/v1/…`.
    Admin,
    /// A gRPC, Connect or gRPC-Web method.
    Api {
        method: crate::methods::MethodInfo,
        proto: Protocol,
    },
}

impl Endpoint {
    /// A failed authentication, in the shape the endpoint's clients read.
    fn refusal(&self, status: &tonic::Status) -> http::Response<HttpBody> {
        match self {
            Endpoint::Kube { .. } => crate::kube_proxy::unauthorized(status.message()),
            Endpoint::Metrics | Endpoint::Admin => {
                plain(http::StatusCode::UNAUTHORIZED, status.message())
            }
            Endpoint::Api { proto, .. } => protocol_error(*proto, status),
        }
    }
}

/// An answer given before the request's body was read. Over HTTP/1.1 the
/// unread body stands between this answer and the connection's next
/// request: a body that is not declared larger than a public message is
/// read and dropped after the answer (bounded in bytes and time), so the
/// connection stays open and a client still writing it does not see its
/// write fail (connect-node reported EPIPE when the hub closed under it).
/// A body declared larger means the connection cannot be used again, so
/// the answer says `Connection: close`.
/// HTTP/2 streams are independent: nothing to do.
pub(crate) fn unread_body(
    mut resp: http::Response<HttpBody>,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let (parts, body) = req.into_parts();
    if parts.version > http::Version::HTTP_11 {
        return resp;
    }
    let chunked = parts.headers.contains_key(http::header::TRANSFER_ENCODING);
    // A client waiting for `100 Continue` sends no body after a final
    // answer: nothing to drain, and the connection cannot go on.
    let expects = parts.headers.contains_key(http::header::EXPECT);
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    // Node's HTTP client sends even a two-byte body chunked: a chunked
    // body is drained too, and the connection dropped only if it turns
    // out larger.
    match declared {
        None | Some(0) if !chunked => return resp,
        _ if expects => {}
        Some(n) if n > crate::limits::MAX_PUBLIC_MESSAGE as u64 => {}
        _ => {
            tokio::spawn(crate::limits::drain(body));
            return resp;
        }
    }
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    resp
}

/// An error before any handler ran, in the shape the protocol expects.
fn protocol_error(proto: Protocol, status: &tonic::Status) -> http::Response<HttpBody> {
    match proto {
        Protocol::Grpc { .. } | Protocol::GrpcWeb { .. } => {
            let mut resp: http::Response<HttpBody> = status.clone().into_http();
            let ct = match proto {
                Protocol::GrpcWeb { text, json } => protocol::grpc_web::content_type(text, json),
                Protocol::Grpc { json: true } => "application/grpc+json",
                _ => "application/grpc",
            };
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(ct),
            );
            resp
        }
        Protocol::ConnectUnary { .. } | Protocol::ConnectGet => {
            protocol::connect::unary_error(status, None)
        }
        Protocol::ConnectStream { json } => {
            protocol::connect::end_stream_only(json, status, &http::HeaderMap::new())
        }
    }
}

/// The gRPC handlers the protocol layer calls into.
#[derive(Clone)]
pub struct GrpcHandler {
    state: Arc<HubState>,
    routes: tonic::service::Routes,
}

impl std::fmt::Debug for GrpcHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrpcHandler")
    }
}

impl GrpcHandler {
    pub async fn call(&self, req: http::Request<HttpBody>) -> http::Response<HttpBody> {
        grpc_call(self.state.clone(), self.routes.clone(), req).await
    }
}

/// One gRPC call: forwarded to a cluster, or served by the hub's own services.
async fn grpc_call(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    req: http::Request<HttpBody>,
) -> http::Response<HttpBody> {
    let started = std::time::Instant::now();
    let path = req.uri().path().to_owned();
    let metrics = state.metrics.clone();
    let resp = match crate::deadline::parse_grpc_timeout(req.headers()) {
        Some(timeout) => {
            let deadline = tokio::time::Instant::now() + timeout;
            match tokio::time::timeout_at(deadline, grpc_handlers(state, routes, req)).await {
                Ok(resp) => crate::deadline::limit(resp, deadline),
                Err(_) => {
                    tonic::Status::deadline_exceeded("the call's deadline passed").into_http()
                }
            }
        }
        None => grpc_handlers(state, routes, req).await,
    };
    crate::metrics::observe(metrics, path, started, resp)
}

/// Largest request message of the hub's own services (Register, ListLinks,
/// manifests, health, reflection): a CSR and a few names are the most any
/// of them carries.
pub const MAX_OWN_MESSAGE: usize = 1024 * 1024;

async fn grpc_handlers(
    state: Arc<HubState>,
    routes: tonic::service::Routes,
    req: http::Request<HttpBody>,
) -> http::Response<HttpBody> {
    // ShowChart names no cluster: the hub fetches the chart itself.
    if req.uri().path() == crate::chart::SHOW_CHART {
        return crate::chart::serve(state.charts.clone(), req).await;
    }
    if forward::is_forwarded(req.uri().path()) {
        return forward::handle(state, req).await;
    }
    // The hub's own services: the first message is measured from its
    // length prefix before anything is buffered, so an oversized one is
    // ResourceExhausted (tonic itself would buffer up to its limit and then
    // say OutOfRange). Every method here is unary or starts with a small
    // message.
    let max = if crate::auth::needs_token(req.uri().path()) {
        MAX_OWN_MESSAGE
    } else {
        crate::limits::MAX_PUBLIC_MESSAGE
    };
    let req = match forward::limit_first_message(req, max).await {
        Ok(req) => req,
        Err(status) => return status.into_http(),
    };
    if req.uri().path() == crate::link_service::LIST_LINKS_PATH {
        return crate::link_service::serve_list_links(state, req).await;
    }
    // Routes is always ready; calling it directly yields its concrete
    // future type, which keeps the compiler's Send analysis simple.
    let mut routes = routes;
    let resp = match tower::Service::call(&mut routes, req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    };
    resp.map(|b| {
        b.map_err(|e| -> protocol::BoxError { Box::new(e) })
            .boxed_unsync()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel is told for a caller that is gone without a word:
    /// probes after the interval of silence, three of them over the timeout.
    #[tokio::test]
    async fn api_connections_probe_a_silent_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _peer = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        probe_when_silent(
            &tcp,
            otter_tunnel::Keepalive {
                interval: Duration::from_secs(30),
                timeout: Duration::from_secs(30),
            },
        );
        let s = socket2::SockRef::from(&tcp);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(30));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(10));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 3);
    }
}
