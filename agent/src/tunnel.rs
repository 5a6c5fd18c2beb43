//! The agent's main loop: get credentials, dial the hub over the first
//! transport that works, serve the streams the hub opens, renew the
//! certificate before it expires, and reconnect with paced backoff when the
//! tunnel goes away.
//!
//! Two parts: the [`Supervisor`] owns policy across tunnels (credentials,
//! transport and replica order, backoff, the hub's hints); a [`Session`]
//! serves one tunnel and returns why it ended.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use otter_pki::tls;
use otter_tunnel::{
    Acceptor, Keepalive, TransportKind,
    frame::Limits,
    h2::{self, H2Settings},
    quic::{self, QuicSettings},
};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use url::Url;

use crate::{
    AgentConfig, AgentError, Result,
    backoff::Backoff,
    dispatch::{AgentService, DiagFn, Goodbye, Own},
    enroll::{self, Credentials},
};

/// What the agent is doing, for tests, health and diagnosis.
#[derive(Debug, Clone, Default)]
pub struct AgentStatus {
    /// Transport of the live tunnel, if one is up.
    pub connected: Option<TransportKind>,
    /// Registrations with a join token.
    pub registrations: u32,
    /// Renewals with the current certificate.
    pub renewals: u32,
    /// Of those, the ones made on the tunnel port (the others went to the
    /// API port).
    pub renewals_on_tunnel_port: u32,
    /// Tunnels established so far.
    pub connects: u32,
    /// Dial rounds so far (each tries the transports in order).
    pub dials: u32,
    /// Dials the hub refused with a retry-after hint (too many agents
    /// connecting or registering at once).
    pub refusals: u32,
    /// The hint of the last refusal.
    pub last_retry_after: Option<Duration>,
    /// The shortest time from a refusal to this agent's next attempt, as
    /// its own clock measured it: what shows, from outside the hub, that
    /// every hint was honoured.
    pub shortest_wait_after_refusal: Option<Duration>,
    /// Switches to a better transport made while connected.
    pub switches: u32,
    /// Moves off a transport that lost too many packets.
    pub quality_moves: u32,
    /// New tunnels dialled beside one whose path went quiet (see
    /// [`quiet_after`]).
    pub quiet_probes: u32,
    /// New tunnels dialled beside one whose hub's host refused its
    /// datagrams (nothing listens on the hub's port any more), before the
    /// path counted as quiet.
    pub refused_probes: u32,
    /// Serial of the current certificate.
    pub cert_serial: String,
    /// Outcome of each transport tried in the last connect round.
    pub attempts: Vec<(TransportKind, Result<(), String>)>,
    /// The proxy the tunnel goes through, without credentials.
    pub proxy: Option<String>,
    pub last_error: String,
    /// Why the last renewal failed; empty once one succeeded.
    pub last_renewal_error: String,
    /// Renewals that failed (each is retried after a backoff).
    pub renewal_failures: u32,
    /// When the current certificate expires (unix seconds).
    pub cert_not_after: i64,
    /// Tunnels moved to a renewed certificate, make before break.
    pub redials: u32,
    /// Who ended the last tunnel, and why; `None` until one ended.
    pub last_tunnel_end: Option<crate::ended::Ended>,
    /// How far the hub's clock is ahead of this agent's (milliseconds), as
    /// last measured on a tunnel; `None` until measured.
    pub clock_skew_ms: Option<i64>,
    /// The tunnel URLs the hub said it serves, on the last tunnel it asked
    /// for a diagnosis; empty until told.
    pub advertised_urls: Vec<Url>,
    /// This agent's last tunnel set-ups (at most [`MAX_SETUPS`]) as it saw
    /// them: from the hub's first sign of admitting it to its answer to
    /// the hub's diagnosis request, a span inside the hub's admission
    /// window. Tests count overlapping spans across agents to check the
    /// hub's bound on set-ups at once from outside the hub.
    pub setups: Vec<(std::time::Instant, std::time::Instant)>,
    /// What the connectivity doctor found when this agent ran it itself,
    /// after [`DOCTOR_AFTER_ROUNDS`] dial rounds failed in a row (once per
    /// such streak); empty until then.
    pub doctor: Vec<crate::doctor::Check>,
    /// When that doctor run ended (unix seconds, the agent's clock).
    pub doctor_at: Option<i64>,
    /// Doctor runs the agent started itself.
    pub doctor_runs: u32,
}

/// Failed dial rounds in a row after which the agent runs its doctor and
/// logs what stands in the way (as `otter-agent doctor` would print it).
pub const DOCTOR_AFTER_ROUNDS: u32 = 3;

/// The longest the agent's own doctor run may take.
const DOCTOR_LIMIT: Duration = Duration::from_secs(60);

/// Set-up spans kept in [`AgentStatus::setups`].
pub const MAX_SETUPS: usize = 16;

/// The most tunnel URLs taken from one advertisement.
const MAX_ADVERTISED_URLS: usize = 16;

/// Bound of one renewal (connect, TLS, Register). It runs beside the
/// tunnel, so waiting this long costs no call anything.
pub const RENEWAL_TIMEOUT: Duration = Duration::from_secs(30);

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    status: watch::Receiver<AgentStatus>,
    gauges: Arc<crate::gauges::Gauges>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Agent {
    /// Starts the agent; `routes` serves every call the hub forwards.
    pub fn start(config: AgentConfig, routes: tonic::service::Routes) -> Result<Agent> {
        Self::start_with_proxy(config, routes, None)
    }

    /// Like [`Agent::start`], also serving the hub's Kubernetes API proxy
    /// requests with `kube`.
    pub fn start_with_proxy(
        config: AgentConfig,
        routes: tonic::service::Routes,
        kube: Option<crate::kube_proxy::KubeProxy>,
    ) -> Result<Agent> {
        config.validate()?;
        tls::install_default_provider();
        let (tx, rx) = watch::channel(AgentStatus::default());
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let gauges = config.gauges.clone();
        let supervisor = Supervisor {
            backoff: Backoff::new(config.backoff_base, config.backoff_cap),
            renew_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(60)),
            config,
            routes,
            kube,
            status: tx,
            shutdown: shutdown.clone(),
            tasks: tasks.clone(),
            creds: None,
            renew_now: Arc::new(tokio::sync::Notify::new()),
            last_good: None,
            demoted: None,
            renew_retry_at: None,
            quic: Arc::new(Dialers::default()),
            failed_rounds: 0,
            failing_since: None,
            urls_refreshed: None,
            failed_with_api_up: false,
            refused_at: None,
            adopted: Vec::new(),
            site: 0,
        };
        tasks.spawn(supervisor.run());
        Ok(Agent {
            status: rx,
            gauges,
            shutdown,
            tasks,
        })
    }

    pub fn status(&self) -> AgentStatus {
        self.status.borrow().clone()
    }

    /// A receiver of status changes (for the health endpoint).
    pub fn status_watch(&self) -> watch::Receiver<AgentStatus> {
        self.status.clone()
    }

    /// Live counts of tunnel streams and sessions.
    pub fn gauges(&self) -> &Arc<crate::gauges::Gauges> {
        &self.gauges
    }

    /// Serves `/healthz`, `/readyz` and `/metrics` on `listener` for as
    /// long as the agent runs.
    pub fn serve_health(&self, listener: tokio::net::TcpListener) {
        self.tasks.spawn(crate::health::serve(
            listener,
            self.status.clone(),
            self.gauges.clone(),
            self.shutdown.clone(),
        ));
    }

    /// Waits until `pred` holds for the status, or `timeout` passes.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&AgentStatus) -> bool,
    ) -> Option<AgentStatus> {
        let mut rx = self.status.clone();
        tokio::time::timeout(timeout, async {
            loop {
                if pred(&rx.borrow_and_update()) {
                    return rx.borrow().clone();
                }
                if rx.changed().await.is_err() {
                    return rx.borrow().clone();
                }
            }
        })
        .await
        .ok()
    }

    /// Stops the agent: the tunnel closes and every stream task ends.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.tasks.wait()).await;
    }
}

/// The agent's policy across tunnels: credentials (register, renew), which
/// transports and which replica to dial and in what order, backoff and the
/// hub's retry hints. Each tunnel it gets is served by a [`Session`], which
/// reports back why the tunnel ended.
struct Supervisor {
    config: AgentConfig,
    routes: tonic::service::Routes,
    kube: Option<crate::kube_proxy::KubeProxy>,
    status: watch::Sender<AgentStatus>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    creds: Option<Credentials>,
    /// Woken when the hub asks for a renewal now (a CA rotation step).
    renew_now: Arc<tokio::sync::Notify>,
    /// The transport that worked last, tried first on a reconnect.
    last_good: Option<TransportKind>,
    /// A transport left for losing too many packets, and until when it is
    /// not probed again.
    demoted: Option<(TransportKind, tokio::time::Instant)>,
    backoff: Backoff,
    /// Failed renewals are retried after 1 s, doubling to a minute.
    renew_backoff: Backoff,
    /// After a failed renewal, when to try again (sooner than it is due).
    renew_retry_at: Option<tokio::time::Instant>,
    /// One QUIC endpoint and the TLS sessions for every dial of this
    /// agent's life.
    quic: Arc<Dialers>,
    /// Dial rounds that failed in a row, since when, and when the tunnel
    /// URLs were last asked for again (see `URL_REFRESH_ROUNDS`).
    failed_rounds: u32,
    failing_since: Option<tokio::time::Instant>,
    urls_refreshed: Option<tokio::time::Instant>,
    /// Whether the API answered when the last round of dials failed: the
    /// tunnel port moved (ask for the URLs again), as opposed to a hub that
    /// was down (a restart: keep the certificate, dial again).
    failed_with_api_up: bool,
    /// When the hub last refused this agent with a hint.
    refused_at: Option<tokio::time::Instant>,
    /// The last tunnel URLs the hub advertised that were taken.
    adopted: Vec<Url>,
    /// Which hub replica's tunnel URLs to dial (see `sites`): the first
    /// listed (the replica that answered) until a round fails, then the next.
    site: usize,
}

/// What the supervisor does after a step that did not give a tunnel.
enum Next {
    /// Go on to the next step.
    Go,
    /// Start the round again (after the pause already taken).
    Again,
    /// The agent is shutting down.
    Stop,
}

impl Supervisor {
    async fn run(mut self) {
        let (config, creds) = kept_identity(self.config.clone()).await;
        self.config = config;
        self.creds = creds;
        if let Some(c) = &self.creds {
            self.status.send_modify(|s| {
                s.cert_serial = c.serial.clone();
                s.cert_not_after = c.not_after;
            });
        }
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            self.note_wait_after_refusal();
            match self.credentials().await {
                Next::Go => {}
                Next::Again => continue,
                Next::Stop => return,
            }
            self.adopt_advertised_urls().await;
            let Some(current) = self.creds.as_ref().map(|c| at_site(c, self.site)) else {
                continue;
            };
            let admitted = match self.connect(&current).await {
                Ok(admitted) => admitted,
                Err(Next::Stop) => return,
                Err(_) => continue,
            };
            let Some(mut why) = Session::start(&mut self, admitted, &current)
                .run(&mut self)
                .await
            else {
                return;
            };
            // A stopping replica names the others: the next round dials
            // them (see `adopt_advertised_urls`).
            let (reason, go_to) = otter_tunnel::frame::go_to(&why.why);
            let go_to = dialable(go_to.into_iter());
            why.why = reason.to_owned();
            if !go_to.is_empty() {
                self.status.send_modify(|s| s.advertised_urls = go_to);
            }
            tracing::info!(closed_by = %why.by, reason = %why.why, "tunnel down");
            // A replica that went silent, reset the connection or said it is
            // stopping is likely gone: the next round dials the next
            // replica's URLs first rather than wait out a QUIC handshake
            // with a dead port (with one replica, or a load balancer, the
            // same URLs).
            if why.by != crate::ended::EndedBy::Hub || why.why == otter_tunnel::frame::BYE_STOPPING
            {
                self.site = self.site.wrapping_add(1);
            }
            self.status.send_modify(|s| {
                s.connected = None;
                s.last_error = why.to_string();
                s.last_tunnel_end = Some(why);
            });
            // Even a clean close waits a little: the agent never spins.
            if !pause(&mut self.backoff, &self.shutdown).await {
                return;
            }
        }
    }

    /// The attempt after a refusal starts now: records how long it waited.
    fn note_wait_after_refusal(&mut self) {
        if let Some(at) = self.refused_at.take() {
            let waited = at.elapsed();
            self.status.send_modify(|s| {
                s.shortest_wait_after_refusal = Some(
                    s.shortest_wait_after_refusal
                        .map_or(waited, |w| w.min(waited)),
                );
            });
        }
    }

    /// Registers on first contact, renews when due; pauses when that fails.
    async fn credentials(&mut self) -> Next {
        // The hub may have moved its tunnel port: after a few failed rounds
        // a renewal (Register) brings its current URLs, at most once a
        // minute, instead of waiting for the certificate to be due.
        // Only when the API answered as the last dials failed: a hub that
        // was down (a restart) has moved nothing, and its agents keep the
        // certificates they have, even when it is back before they dial.
        let refresh_urls = self.failed_rounds >= URL_REFRESH_ROUNDS
            && self
                .failing_since
                .is_some_and(|t| t.elapsed() >= URL_REFRESH_AFTER)
            && self
                .urls_refreshed
                .is_none_or(|t| t.elapsed() >= URL_REFRESH_EVERY)
            && self.failed_with_api_up;
        let due = self
            .creds
            .as_ref()
            .is_none_or(|c| self.config.clock.now() >= c.renew_at(self.config.renew_at));
        if !due && !refresh_urls {
            return Next::Go;
        }
        if refresh_urls {
            self.urls_refreshed = Some(tokio::time::Instant::now());
            tracing::info!(
                failed_rounds = self.failed_rounds,
                "asking the hub for its tunnel URLs again"
            );
        }
        match obtain(&self.config, self.creds.as_ref(), &self.status).await {
            Ok(c) => {
                self.creds = Some(c);
                self.failed_rounds = 0;
                self.failing_since = None;
                self.site = 0;
                Next::Go
            }
            Err(e) => {
                tracing::warn!(error = %e, "register failed");
                let hint = e.retry_after();
                self.status.send_modify(|s| {
                    s.last_error = e.to_string();
                });
                self.wait(hint).await
            }
        }
    }

    /// Pauses after a failed step: the hub's hint when it gave one (counted
    /// as a refusal), else the backoff.
    async fn wait(&mut self, hint: Option<Duration>) -> Next {
        let go_on = match hint {
            Some(after) => {
                self.refused_at = Some(tokio::time::Instant::now());
                self.status.send_modify(|s| {
                    s.refusals += 1;
                    s.last_retry_after = hint;
                });
                pause_at_least(after, &self.shutdown).await
            }
            None => pause(&mut self.backoff, &self.shutdown).await,
        };
        if go_on { Next::Again } else { Next::Stop }
    }

    /// One connect round: the transports in order, first that works. A
    /// tunnel counts once the hub has admitted it, which it shows by
    /// opening the first stream; a hub that is busy says when to come back
    /// instead, and then no other transport is tried either.
    async fn connect(&mut self, current: &Credentials) -> std::result::Result<Admitted, Next> {
        self.status.send_modify(|s| s.dials += 1);
        let mut attempts = Vec::new();
        let mut hint = None;
        for kind in &dial_order(&self.config.transports, self.last_good) {
            let started = tokio::time::Instant::now();
            match dial_admitted(&self.config, current, *kind, &self.quic).await {
                Ok(admitted) => {
                    attempts.push((*kind, Ok(())));
                    self.last_good = Some(*kind);
                    self.failed_rounds = 0;
                    self.failing_since = None;
                    self.status.send_modify(|s| s.attempts = attempts);
                    return Ok(admitted);
                }
                Err(e) => {
                    tracing::info!(
                        transport = %kind,
                        cluster = %self.config.cluster,
                        took_ms = started.elapsed().as_millis() as u64,
                        error = %e,
                        "transport failed"
                    );
                    attempts.push((*kind, Err(e.to_string())));
                    if let Some(after) = e.retry_after() {
                        hint = Some(after);
                        break;
                    }
                }
            }
        }
        if hint.is_none() {
            // The next round tries the next replica's URLs, if the hub
            // listed more than one (replicas without a load balancer).
            self.site = self.site.wrapping_add(1);
            self.failed_rounds += 1;
            self.failing_since
                .get_or_insert_with(tokio::time::Instant::now);
            self.failed_with_api_up = self.failed_rounds >= URL_REFRESH_ROUNDS
                && self
                    .failing_since
                    .is_some_and(|t| t.elapsed() >= URL_REFRESH_AFTER)
                && api_reachable(&self.config).await;
            if self.failed_rounds == DOCTOR_AFTER_ROUNDS {
                self.run_doctor();
            }
        }
        self.status.send_modify(|s| {
            s.last_error = format!("no transport worked: {attempts:?}");
            s.attempts = attempts;
        });
        Err(self.wait(hint).await)
    }

    /// Runs the connectivity doctor beside the dial loop (bounded) and
    /// keeps and logs what it found: the owner reads the cause in the
    /// agent's log and status instead of guessing from dial errors.
    fn run_doctor(&self) {
        self.status.send_modify(|s| s.doctor_runs += 1);
        let (config, status) = (self.config.clone(), self.status.clone());
        let creds = self.creds.clone();
        self.tasks.spawn(async move {
            let run = crate::doctor::run_with(&config, creds);
            let Ok(checks) = tokio::time::timeout(DOCTOR_LIMIT, run).await
            else {
                return tracing::warn!("the connectivity doctor did not finish within a minute");
            };
            for c in checks
                .iter()
                .filter(|c| c.verdict != crate::doctor::Verdict::Ok)
            {
                tracing::warn!(check = c.name, verdict = c.verdict.word(), detail = %c.detail, "connectivity doctor");
            }
            let at = config.clock.now();
            status.send_modify(|s| {
                s.doctor = checks;
                s.doctor_at = Some(at);
            });
        });
    }

    /// Takes the URLs the hub advertised last (see the free function);
    /// new ones send the next dial to the first replica listed.
    async fn adopt_advertised_urls(&mut self) {
        if adopt_advertised_urls(
            &self.config,
            &mut self.creds,
            &self.status,
            &mut self.adopted,
        )
        .await
        {
            self.site = 0;
        }
    }

    /// The one service for every stream of a tunnel whose diagnosis
    /// `diag` makes.
    fn service(&self, diag: DiagFn) -> AgentService {
        AgentService::new(
            self.routes.clone(),
            self.kube.as_ref().map(|k| k.service()),
            Own {
                diag,
                renew: self.renew_now.clone(),
                goodbye: Goodbye::default(),
            },
        )
    }

    /// The credentials at the current site, or `fallback` without any.
    fn newest(&self, fallback: &Credentials) -> Credentials {
        self.creds
            .as_ref()
            .map_or_else(|| fallback.clone(), |c| at_site(c, self.site))
    }

    /// When the next renewal is due: the retry after a failed one, else
    /// the certificate's renewal point.
    fn renew_in(&self) -> Duration {
        match self.renew_retry_at {
            Some(at) => at.saturating_duration_since(tokio::time::Instant::now()),
            None => Duration::from_secs(self.creds.as_ref().map_or(0, |c| {
                (c.renew_at(self.config.renew_at) - self.config.clock.now()).max(0)
            }) as u64),
        }
    }

    /// A renewal's outcome. A new certificate is kept and returned (the
    /// session moves to a tunnel on it); a failure is retried after a
    /// backoff, well before expiry, the tunnel serving meanwhile.
    fn renewed(&mut self, renewed: Result<Credentials>) -> Option<Credentials> {
        match renewed {
            Ok(c) => {
                self.creds = Some(c.clone());
                self.renew_backoff.reset();
                self.renew_retry_at = None;
                Some(c)
            }
            Err(e) => {
                let retry_in = self.renew_backoff.next_delay().max(Duration::from_secs(1));
                self.renew_retry_at = Some(tokio::time::Instant::now() + retry_in);
                // How long the certificate has left, by the hub's clock.
                let left = self
                    .creds
                    .as_ref()
                    .map_or(0, |c| c.not_after - (self.config.clock.now() + c.skew));
                tracing::warn!(error = %e, ?retry_in, certificate_expires_in_secs = left, "renewal failed");
                self.status.send_modify(|s| {
                    s.last_error = e.to_string();
                    s.last_renewal_error = e.to_string();
                    s.renewal_failures += 1;
                });
                None
            }
        }
    }
}

/// One tunnel, served until it ends: the streams the hub opens, a renewal
/// beside it when due (the tunnel moves to the new certificate, make before
/// break), and a move to a better transport when one works again.
struct Session {
    acceptor: Box<dyn AcceptorDyn>,
    kind: TransportKind,
    /// The credentials the tunnel was dialled with.
    current: Credentials,
    service: AgentService,
    probe_at: Option<tokio::time::Instant>,
    /// A new tunnel is being set up beside this one.
    probing: bool,
    /// Where a new tunnel being set up reports; a probe of a session that
    /// ended finds the receiver gone, and the tunnel it found is dropped.
    probe_tx: tokio::sync::mpsc::Sender<Option<Admitted>>,
    probe_rx: tokio::sync::mpsc::Receiver<Option<Admitted>>,
    /// A renewal runs beside the tunnel, never in the serving loop: a hub
    /// API that does not answer must not stop the calls on the tunnel.
    renewing: bool,
    renew_tx: tokio::sync::mpsc::Sender<Result<Credentials>>,
    renew_rx: tokio::sync::mpsc::Receiver<Result<Credentials>>,
    /// The tunnel ended while a new one was being set up: why, and until
    /// when the new one is waited for.
    closing: Option<(crate::ended::Ended, tokio::time::Instant)>,
    /// The proxy the tunnel goes through, for how it ended.
    route: Option<String>,
    /// When the path's losses are next looked at, and the counts then.
    quality_at: tokio::time::Instant,
    counted: Option<otter_tunnel::PathCounts>,
    /// When the path's datagrams are next counted, and the count with
    /// the moment it last grew.
    quiet_at: tokio::time::Instant,
    heard: Option<(u64, tokio::time::Instant)>,
    /// The hub's refusals of this path's datagrams counted so far, and
    /// whether one already started a dial since the hub was last heard.
    refused: (u64, bool),
    /// The dial beside a quiet tunnel while it runs, and the site it dials.
    quiet_probe: Option<(tokio::task::AbortHandle, usize)>,
}

impl Session {
    /// Takes a tunnel the hub admitted and serves its first stream.
    fn start(sup: &mut Supervisor, admitted: Admitted, current: &Credentials) -> Session {
        let Admitted {
            acceptor,
            first,
            setup_started,
        } = admitted;
        let kind = acceptor.kind_dyn();
        let config = &sup.config;
        // What the hub asks for to show how this agent got through.
        let route = proxy_route(config, current, kind);
        let attempts = sup.status.borrow().attempts.clone();
        let diag = diagnosis(
            config,
            &attempts,
            route.as_deref(),
            &sup.status,
            setup_started,
        );
        tracing::info!(transport = %kind, cluster = %config.cluster, "tunnel up");
        sup.status.send_modify(|s| {
            s.connected = Some(kind);
            s.connects += 1;
            s.proxy = route.clone();
        });
        sup.backoff.reset();
        let service = sup.service(diag);
        serve_one(&sup.tasks, first, &service, &config.gauges);
        let (probe_tx, probe_rx) = tokio::sync::mpsc::channel(1);
        let (renew_tx, renew_rx) = tokio::sync::mpsc::channel(1);
        Session {
            acceptor,
            kind,
            current: current.clone(),
            service,
            probe_at: next_probe(config, kind),
            probing: false,
            probe_tx,
            probe_rx,
            renewing: false,
            renew_tx,
            renew_rx,
            closing: None,
            route,
            quality_at: tokio::time::Instant::now() + QUALITY_WINDOW,
            counted: None,
            quiet_at: tokio::time::Instant::now() + quiet_tick(config.keepalive),
            heard: None,
            refused: (0, false),
            quiet_probe: None,
        }
    }

    /// Serves until the tunnel ends, and says why; `None` when the agent
    /// is shutting down.
    async fn run(mut self, sup: &mut Supervisor) -> Option<crate::ended::Ended> {
        loop {
            // The skew measured on the tunnel (the hub's clock comes with
            // each diagnosis request) schedules renewals from now on.
            if let (Some(c), Some(ms)) = (sup.creds.as_mut(), sup.status.borrow().clock_skew_ms) {
                c.skew = (ms as f64 / 1000.0).round() as i64;
            }
            sup.adopt_advertised_urls().await;
            let renew_in = sup.renew_in();
            tokio::select! {
                next = self.acceptor.accept_dyn(), if self.closing.is_none() => {
                    let why = match next {
                        Ok(Some(stream)) => {
                            serve_one(&sup.tasks, stream, &self.service, &sup.config.gauges);
                            continue;
                        }
                        end => {
                            let said = self.service.take_goodbye();
                            crate::ended::classify(&end, said, self.route.as_deref())
                        }
                    };
                    // A quiet tunnel that ends was dead: reconnect as after
                    // any end, without waiting out the dial beside it.
                    if let Some((probe, _)) = self.quiet_probe.take() {
                        probe.abort();
                        return Some(why);
                    }
                    // The hub closes a replaced tunnel once it admitted the
                    // new one (a better transport, a renewed certificate),
                    // which can be before the new one reaches this loop:
                    // wait for it (bounded) rather than reconnect.
                    if !self.probing {
                        return Some(why);
                    }
                    self.closing = Some((why, tokio::time::Instant::now() + sup.config.connect_timeout));
                }
                _ = sleep_until_some(self.closing.as_ref().map(|(_, at)| *at)) => {
                    if let Some((why, _)) = self.closing.take() {
                        return Some(why);
                    }
                }
                // When due, or at once when the hub asks (a CA rotation step).
                _ = async {
                    tokio::select! {
                        _ = tokio::time::sleep(renew_in) => {}
                        _ = sup.renew_now.notified() => {}
                    }
                }, if !self.renewing => self.renew(sup),
                Some(renewed) = self.renew_rx.recv() => {
                    self.renewing = false;
                    // The hub honours this tunnel only until the certificate
                    // it was opened with expires: move to a tunnel on the
                    // new one, make before break, as for a better transport.
                    if let Some(c) = sup.renewed(renewed)
                        && !self.probing
                    {
                        // The replica that renewed it lists its own URLs first.
                        sup.site = 0;
                        let order = dial_order(&sup.config.transports, Some(self.kind));
                        self.dial_beside(sup, at_site(&c, sup.site), order);
                    }
                }
                _ = sleep_until_some(self.probe_at), if !self.probing => {
                    let newest = sup.newest(&self.current);
                    let mut better = better_than(&sup.config.transports, self.kind);
                    let now = tokio::time::Instant::now();
                    better.retain(|k| !sup.demoted.is_some_and(|(d, until)| d == *k && now < until));
                    if better.is_empty() {
                        self.probe_at = next_probe(&sup.config, self.kind);
                    } else {
                        self.dial_beside(sup, newest, better);
                    }
                }
                _ = tokio::time::sleep_until(self.quality_at) => self.check_losses(sup),
                _ = tokio::time::sleep_until(self.quiet_at) => self.check_quiet(sup),
                Some(found) = self.probe_rx.recv() => {
                    self.probing = false;
                    let quiet = self.quiet_probe.take();
                    match found {
                        Some(better) => {
                            if let Some((_, site)) = quiet {
                                sup.site = site;
                            }
                            self.move_to(sup, better);
                        }
                        None => {
                            if let Some((why, _)) = self.closing.take() {
                                return Some(why);
                            }
                            self.probe_at = next_probe(&sup.config, self.kind);
                        }
                    }
                }
                _ = sup.shutdown.cancelled() => return None,
            }
        }
    }

    /// Starts a renewal beside the tunnel, bounded by [`RENEWAL_TIMEOUT`].
    fn renew(&mut self, sup: &Supervisor) {
        self.renewing = true;
        let (config, current, status, tx) = (
            sup.config.clone(),
            sup.creds.clone(),
            sup.status.clone(),
            self.renew_tx.clone(),
        );
        sup.tasks.spawn(async move {
            let renewed =
                tokio::time::timeout(RENEWAL_TIMEOUT, obtain(&config, current.as_ref(), &status))
                    .await
                    .unwrap_or_else(|_| {
                        Err(AgentError::Connect(format!(
                            "renewal got no answer within {} s",
                            RENEWAL_TIMEOUT.as_secs()
                        )))
                    });
            let _ = tx.send(renewed).await;
        });
    }

    /// Moves to the next transport configured, make before break, when
    /// the path lost more than `max_loss` of the packets sent over the
    /// last [`QUALITY_WINDOW`] (at least [`QUALITY_MIN_PACKETS`] of them:
    /// an idle tunnel's keepalives say too little).
    fn check_losses(&mut self, sup: &mut Supervisor) {
        self.quality_at = tokio::time::Instant::now() + QUALITY_WINDOW;
        let Some(now) = self.acceptor.packets_dyn() else {
            return;
        };
        let Some(before) = self.counted.replace(now) else {
            return;
        };
        let sent = now.sent.saturating_sub(before.sent);
        let lost = now.lost.saturating_sub(before.lost);
        let max = sup.config.max_loss;
        if self.probing
            || max <= 0.0
            || sent < QUALITY_MIN_PACKETS
            || (lost as f64) <= sent as f64 * max
        {
            return;
        }
        let worse: Vec<TransportKind> = sup
            .config
            .transports
            .iter()
            .skip_while(|k| **k != self.kind)
            .skip(1)
            .copied()
            .collect();
        if worse.is_empty() {
            return;
        }
        tracing::warn!(
            transport = %self.kind,
            lost,
            sent,
            window_secs = QUALITY_WINDOW.as_secs(),
            "the tunnel loses too many packets: moving to the next transport, make before break"
        );
        sup.demoted = Some((self.kind, tokio::time::Instant::now() + DEMOTED_FOR));
        sup.status.send_modify(|s| s.quality_moves += 1);
        let newest = sup.newest(&self.current);
        self.dial_beside(sup, newest, worse);
    }

    /// Dials a new tunnel beside this one, make before break, once its path
    /// has been quiet for [`quiet_after`]. Both ends keep alive, so a live
    /// path is heard from every interval; one quiet for longer has lost
    /// the hub (a restart whose stateless reset never reached this agent,
    /// a replica gone), and the keepalive timeout would call it dead only
    /// at three intervals. If the hub answers the new dial, calls move to
    /// it (the hub drains the old tunnel, if it still knows it); if not,
    /// the old tunnel stays until its keepalive timeout.
    ///
    /// A path whose datagrams the hub's host refused meanwhile (nothing
    /// listens on the hub's port: its process died, where TCP would have
    /// been reset) and that has heard nothing since the last look is not
    /// waited on: the dial goes out at once, once per such spell. A forged
    /// refusal costs a dial beside a live tunnel, which then stays.
    fn check_quiet(&mut self, sup: &mut Supervisor) {
        let now = tokio::time::Instant::now();
        let keepalive = sup.config.keepalive;
        self.quiet_at = now + quiet_tick(keepalive);
        let Some(counts) = self.acceptor.packets_dyn() else {
            // TCP keeps its counts to itself (and a restarted hub's
            // kernel answers it with a reset at once).
            self.quiet_at = now + NOT_COUNTED;
            return;
        };
        let newly_refused = counts.refused > self.refused.0;
        self.refused.0 = counts.refused;
        let since = match self.heard {
            Some((n, since)) if n == counts.received => since,
            _ => {
                self.heard = Some((counts.received, now));
                self.refused.1 = false;
                return;
            }
        };
        let refused = newly_refused && !self.refused.1;
        if self.probing || (!refused && now.duration_since(since) < quiet_after(keepalive)) {
            return;
        }
        let quiet_ms = now.duration_since(since).as_millis() as u64;
        if refused {
            tracing::info!(
                transport = %self.kind,
                quiet_ms,
                "the hub's host refused this tunnel's datagrams (nothing listens there): dialling a new tunnel beside this one"
            );
            self.refused.1 = true;
            sup.status.send_modify(|s| s.refused_probes += 1);
        } else {
            tracing::info!(
                transport = %self.kind,
                quiet_ms,
                "nothing heard from the hub: dialling a new tunnel beside this one"
            );
            sup.status.send_modify(|s| s.quiet_probes += 1);
        }
        // Not again for this count until another quiet spell has passed.
        self.heard = Some((counts.received, now));
        // The next site's URLs, as after a tunnel that went silent: with
        // replicas and no load balancer the quiet one is likely gone (with
        // one hub, or a load balancer, the same URLs).
        let site = sup.site.wrapping_add(1);
        let creds = sup
            .creds
            .as_ref()
            .map_or_else(|| self.current.clone(), |c| at_site(c, site));
        let order = dial_order(&sup.config.transports, Some(self.kind));
        let probe = self.dial_beside(sup, creds, order);
        self.quiet_probe = Some((probe, site));
    }

    /// Sets up a new tunnel over the first of `order` that works, off the
    /// serving loop, so calls keep being served meanwhile.
    fn dial_beside(
        &mut self,
        sup: &Supervisor,
        creds: Credentials,
        order: Vec<TransportKind>,
    ) -> tokio::task::AbortHandle {
        self.probing = true;
        sup.tasks
            .spawn(dial_new_tunnel(
                sup.config.clone(),
                creds,
                order,
                sup.quic.clone(),
                self.probe_tx.clone(),
            ))
            .abort_handle()
    }

    /// Make before break: the hub routes new calls to the newest tunnel of
    /// this agent and drains the old one, which goes on serving its calls
    /// until the hub closes it.
    fn move_to(&mut self, sup: &mut Supervisor, better: Admitted) {
        self.closing = None;
        let Admitted {
            acceptor,
            first,
            setup_started,
        } = better;
        let old = std::mem::replace(&mut self.acceptor, acceptor);
        self.counted = None;
        self.heard = None;
        self.quiet_at = tokio::time::Instant::now() + quiet_tick(sup.config.keepalive);
        let new_kind = self.acceptor.kind_dyn();
        let moved = new_kind != self.kind;
        tracing::info!(from = %self.kind, to = %new_kind, "moved to a new tunnel");
        sup.tasks.spawn(serve_until_closed(
            old,
            sup.tasks.clone(),
            self.service.clone(),
            sup.config.gauges.clone(),
            sup.shutdown.clone(),
        ));
        self.kind = new_kind;
        sup.last_good = Some(new_kind);
        let newest = sup.newest(&self.current);
        self.route = proxy_route(&sup.config, &newest, new_kind);
        // A switch reports the probe that found the better transport; a
        // redial on a renewed certificate keeps the connect round's report
        // (what failed before it worked).
        if moved {
            sup.status
                .send_modify(|s| s.attempts = vec![(new_kind, Ok(()))]);
        }
        let attempts = sup.status.borrow().attempts.clone();
        let diag = diagnosis(
            &sup.config,
            &attempts,
            self.route.as_deref(),
            &sup.status,
            setup_started,
        );
        self.service = sup.service(diag);
        serve_one(&sup.tasks, first, &self.service, &sup.config.gauges);
        self.probe_at = next_probe(&sup.config, new_kind);
        sup.status.send_modify(|s| {
            s.connected = Some(new_kind);
            // A better transport counts as a connect and a switch; a new
            // tunnel on a renewed certificate as a redial.
            if moved {
                s.switches += 1;
                s.connects += 1;
            } else {
                s.redials += 1;
            }
        });
    }
}

/// The report the hub asks for (`diag`), made when asked: the transports
/// tried and the proxy (fixed for the tunnel), and the agent's state then
/// (renewals, clock skew, how its last tunnel ended). The hub's clock in
/// the request measures the skew again, on every tunnel.
fn diagnosis(
    config: &AgentConfig,
    attempts: &[(TransportKind, Result<(), String>)],
    route: Option<&str>,
    status: &watch::Sender<AgentStatus>,
    setup_started: std::time::Instant,
) -> DiagFn {
    let fixed = serde_json::json!({
        "attempts": attempts.iter().map(|(t, r)| serde_json::json!({
            "transport": t.as_str(),
            "ok": r.is_ok(),
            "error": r.as_ref().err().cloned().unwrap_or_default(),
        })).collect::<Vec<_>>(),
        "proxy": route,
    });
    let (status, clock) = (status.clone(), config.clock);
    let answered = std::sync::atomic::AtomicBool::new(false);
    Arc::new(move |headers: &http::HeaderMap| {
        // The first answer on a tunnel ends its set-up.
        if !answered.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let span = (setup_started, std::time::Instant::now());
            status.send_modify(|s| {
                if s.setups.len() == MAX_SETUPS {
                    s.setups.remove(0);
                }
                s.setups.push(span);
            });
        }
        let hub_ms = headers
            .get(otter_tunnel::frame::HUB_TIME_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i64>().ok());
        if let Some(hub_ms) = hub_ms {
            let skew = hub_ms.saturating_sub(clock.now_millis());
            status.send_if_modified(|s| {
                let changed = s.clock_skew_ms != Some(skew);
                s.clock_skew_ms = Some(skew);
                changed
            });
        }
        let advertised: Vec<Url> = headers
            .get(otter_tunnel::frame::TUNNEL_URLS_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(|v| dialable(v.split(',')))
            .unwrap_or_default();
        if !advertised.is_empty() {
            status.send_if_modified(|s| {
                let changed = s.advertised_urls != advertised;
                s.advertised_urls = advertised;
                changed
            });
        }
        let s = status.borrow();
        let mut report = fixed.clone();
        report["clock_skew_ms"] = s.clock_skew_ms.into();
        report["last_renewal_error"] = s.last_renewal_error.clone().into();
        report["renewal_failures"] = s.renewal_failures.into();
        report["last_tunnel_end"] = s.last_tunnel_end.as_ref().map(|e| e.to_string()).into();
        // What the agent's own doctor found while it could not connect, for
        // `otter links describe` once it can.
        if !s.doctor.is_empty() {
            report["doctor"] = s
                .doctor
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "check": c.name, "verdict": c.verdict.word(), "detail": c.detail,
                    })
                })
                .collect::<Vec<_>>()
                .into();
            report["doctor_at"] = s.doctor_at.into();
        }
        bytes::Bytes::from(report.to_string())
    })
}

/// The tunnel URLs of a list from the hub that an agent can dial: one of
/// its transports and a host; at most [`MAX_ADVERTISED_URLS`].
fn dialable<'a>(urls: impl Iterator<Item = &'a str>) -> Vec<Url> {
    urls.filter_map(|u| Url::parse(u.trim()).ok())
        .filter(|u| u.scheme().parse::<TransportKind>().is_ok() && u.host().is_some())
        .take(MAX_ADVERTISED_URLS)
        .collect()
}

/// Takes the tunnel URLs the hub advertised on its last diagnosis request
/// into the credentials (and keeps them with them) when they differ: the
/// next dial (a reconnect, a probe, a redial) goes where the hub serves
/// tunnels now, not where it did when this agent registered.
///
/// Each advertisement is taken once (`adopted` is the last one taken): a
/// Register after it (a moved port found by a renewal) brings newer URLs,
/// which an older advertisement must not overwrite.
///
/// Whether the credentials' URLs changed.
async fn adopt_advertised_urls(
    config: &AgentConfig,
    creds: &mut Option<Credentials>,
    status: &watch::Sender<AgentStatus>,
    adopted: &mut Vec<Url>,
) -> bool {
    let Some(c) = creds.as_mut() else {
        return false;
    };
    // Runs once per stream the hub opens: compared in place, copied only
    // when there is something new to take.
    let urls = {
        let s = status.borrow();
        if s.advertised_urls.is_empty() || s.advertised_urls == *adopted {
            return false;
        }
        s.advertised_urls.clone()
    };
    *adopted = urls.clone();
    if urls == c.tunnel_urls {
        return false;
    }
    let shown: Vec<&str> = urls.iter().map(Url::as_str).collect();
    tracing::info!(urls = ?shown, "the hub serves tunnels at new URLs");
    c.tunnel_urls = urls;
    if let Some(store) = &config.state
        && let Err(e) = store.save(c).await
    {
        tracing::warn!(error = %e, "could not keep the hub's new tunnel URLs");
    }
    true
}

/// The tunnel URLs grouped by where they lead (host and port), in the
/// order the hub listed them: with hub replicas, one group per replica
/// (the one that answered first). A port that serves several transports
/// is one group.
fn sites(urls: &[Url]) -> Vec<Vec<Url>> {
    let mut groups: Vec<Vec<Url>> = Vec::new();
    for u in urls {
        let place = (u.host_str(), u.port());
        match groups
            .iter_mut()
            .find(|g| (g[0].host_str(), g[0].port()) == place)
        {
            Some(g) => g.push(u.clone()),
            None => groups.push(vec![u.clone()]),
        }
    }
    groups
}

/// `creds` dialling only the URLs of site `site` (counted round and
/// round); all of them when the hub listed none.
fn at_site(creds: &Credentials, site: usize) -> Credentials {
    let groups = sites(&creds.tunnel_urls);
    let mut at = creds.clone();
    if !groups.is_empty() {
        at.tunnel_urls = groups[site % groups.len()].clone();
    }
    at
}

/// The proxy a tunnel over `kind` actually goes through (without its
/// credentials): none when no proxy is set or `NO_PROXY` exempts the hub's
/// tunnel host, so `otter links -o wide` shows the route taken.
fn proxy_route(config: &AgentConfig, creds: &Credentials, kind: TransportKind) -> Option<String> {
    let proxy = config.proxy.as_ref()?;
    let url = tunnel_url(&creds.tunnel_urls, kind, &config.hub_url).ok()?;
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port_or_known_default()?;
    (!proxy.bypass(host, port) && kind != TransportKind::Quic).then(|| proxy.display())
}

/// The configured order, with the transport that worked last moved first:
/// an agent behind a firewall that drops UDP does not wait for QUIC to time
/// out on every reconnect (better ones are retried while connected).
fn dial_order(
    configured: &[TransportKind],
    last_good: Option<TransportKind>,
) -> Vec<TransportKind> {
    let mut order: Vec<TransportKind> = last_good
        .filter(|k| configured.contains(k))
        .into_iter()
        .collect();
    order.extend(configured.iter().filter(|k| Some(**k) != last_good));
    order
}

/// How often a tunnel's losses are looked at.
const QUALITY_WINDOW: Duration = Duration::from_secs(10);
/// Packets a window needs before its losses say anything.
const QUALITY_MIN_PACKETS: u64 = 200;
/// How long a transport left for its losses is not probed again.
const DEMOTED_FOR: Duration = Duration::from_secs(10 * 60);

/// How long a path may go unheard before a new tunnel is dialled beside
/// it: one keepalive interval and a half (the hub's keepalive or the
/// answer to the agent's own is due within one), well inside the
/// keepalive timeout.
fn quiet_after(keepalive: Keepalive) -> Duration {
    (keepalive.interval * 3 / 2).min(keepalive.timeout / 2)
}

/// When a path's datagrams are looked at again on a transport that does
/// not count them (until a move to one that does).
const NOT_COUNTED: Duration = Duration::from_secs(24 * 3600);

/// How often the path's datagrams are counted for [`quiet_after`].
fn quiet_tick(keepalive: Keepalive) -> Duration {
    (keepalive.interval / 4).max(Duration::from_millis(50))
}

/// Transports the configuration ranks above `current`.
fn better_than(configured: &[TransportKind], current: TransportKind) -> Vec<TransportKind> {
    configured
        .iter()
        .take_while(|k| **k != current)
        .copied()
        .collect()
}

/// When to try better transports next, if there are any and retrying is on:
/// the interval, give or take a quarter, so agents do not probe in step.
fn next_probe(config: &AgentConfig, current: TransportKind) -> Option<tokio::time::Instant> {
    if config.transport_retry.is_zero() || better_than(&config.transports, current).is_empty() {
        return None;
    }
    let base = config.transport_retry.as_secs_f64();
    let jitter = base * (0.75 + rand::random::<f64>() * 0.5);
    Some(tokio::time::Instant::now() + Duration::from_secs_f64(jitter))
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Serves one stream the hub opened, on its own task.
fn serve_one(
    tasks: &TaskTracker,
    stream: otter_tunnel::TunnelStream,
    service: &AgentService,
    gauges: &Arc<crate::gauges::Gauges>,
) {
    let service = service.clone();
    // Counted for as long as the stream is served, however it ends.
    let counted = gauges.stream();
    tasks.spawn(async move {
        let _counted = counted;
        if let Err(e) = otter_tunnel::http::serve(stream, service, Limits::default()).await {
            tracing::debug!(error = %e, "stream ended with an error");
        }
    });
}

/// How long a replaced tunnel is kept for its calls in flight, at most
/// (the hub closes it sooner, once they are done).
const REPLACED_TUNNEL_LIMIT: Duration = Duration::from_secs(20 * 60);

/// Keeps serving a tunnel replaced by a better one until the hub closes it.
async fn serve_until_closed(
    mut old: Box<dyn AcceptorDyn>,
    tasks: TaskTracker,
    service: AgentService,
    gauges: Arc<crate::gauges::Gauges>,
    shutdown: CancellationToken,
) {
    let serve = async {
        while let Ok(Some(stream)) = old.accept_dyn().await {
            serve_one(&tasks, stream, &service, &gauges);
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(REPLACED_TUNNEL_LIMIT, serve) => {}
        _ = shutdown.cancelled() => {}
    }
}

/// The credentials an earlier run kept, and the config to go on with: as
/// the agent those credentials name, and with the join token kept beside
/// them when the config has none.
async fn kept_identity(mut config: AgentConfig) -> (AgentConfig, Option<Credentials>) {
    let Some(store) = config.state.clone() else {
        return (config, None);
    };
    let creds = match store.load(config.clock.now()).await {
        Ok(creds) => creds,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the kept identity");
            None
        }
    };
    match &creds {
        Some(c) if c.agent_id != config.agent_id => {
            tracing::info!(kept = %c.agent_id, this = %config.agent_id, "going on as the agent the kept identity names");
            config.agent_id = c.agent_id.clone();
        }
        Some(_) => {}
        None if config.join_token.0.is_empty() => match store.join_token().await {
            Ok(Some(token)) => config.join_token = crate::config::Secret(token),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "could not read the join token"),
        },
        None => {}
    }
    (config, creds)
}

/// Registers or renews; a renewal the hub refuses falls back to the join
/// token, when there is one.
async fn obtain(
    config: &AgentConfig,
    current: Option<&Credentials>,
    status: &watch::Sender<AgentStatus>,
) -> Result<Credentials> {
    let renewed = match current {
        Some(c) => match enroll::register(config, Some(c)).await {
            Ok((new, via)) => {
                status.send_modify(|s| {
                    s.renewals += 1;
                    if via == enroll::Via::TunnelPort {
                        s.renewals_on_tunnel_port += 1;
                    }
                    s.cert_serial = new.serial.clone();
                    s.cert_not_after = new.not_after;
                    s.last_renewal_error.clear();
                });
                return Ok(new);
            }
            // A busy hub is not a refused renewal: come back later.
            Err(e) if e.retry_after().is_some() => return Err(e),
            Err(e) => Some(e),
        },
        None => None,
    };
    if config.join_token.0.is_empty() {
        return Err(renewed.unwrap_or_else(|| {
            AgentError::Config("no join token and no saved certificate".into())
        }));
    }
    let (new, _) = enroll::register(config, None)
        .await
        .map_err(|enrollment| reported_error(renewed, enrollment))?;
    status.send_modify(|s| {
        s.registrations += 1;
        s.cert_serial = new.serial.clone();
        s.cert_not_after = new.not_after;
    });
    Ok(new)
}

/// What a failed [`obtain`] reports when the join token was tried after a
/// renewal failed. That token is usually the spent one that enrolled this
/// agent, so its refusal says what to do only when the hub refused the
/// renewal too (a replaced agent, a re-enrollment); a renewal that did not
/// reach the hub, or that the hub failed, is the reason to report (a
/// storm's slowest agents read "join token was already used" while their
/// hub restarted). A busy answer stands whatever the renewal's error: its
/// retry hint is when to come back, and without it the agent would back off
/// instead. So what the agent does next is the same either way; only what
/// it says changes.
fn reported_error(renewal: Option<AgentError>, enrollment: AgentError) -> AgentError {
    match renewal {
        Some(renewal) if !renewal.refused_by_hub() && enrollment.retry_after().is_none() => {
            tracing::debug!(error = %enrollment, "the join token did not help either");
            renewal
        }
        _ => enrollment,
    }
}

/// Sleeps for the next backoff delay; false when shutting down.
async fn pause(backoff: &mut Backoff, shutdown: &CancellationToken) -> bool {
    let delay = backoff.next_delay().max(Duration::from_millis(50));
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = shutdown.cancelled() => false,
    }
}

/// Sleeps for the hub's hint and up to as long again, drawn at random, so
/// agents the hub turned away together do not come back together; false
/// when shutting down. The exponential backoff, which is for a hub that
/// does not answer, does not grow: this hub answered and said when.
async fn pause_at_least(after: Duration, shutdown: &CancellationToken) -> bool {
    let delay = (after + after.mul_f64(rand::random::<f64>())).max(Duration::from_millis(50));
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = shutdown.cancelled() => false,
    }
}

/// A tunnel the hub admitted.
struct Admitted {
    acceptor: Box<dyn AcceptorDyn>,
    /// The hub's first stream on it (its diagnosis request).
    first: otter_tunnel::TunnelStream,
    /// The first moment this agent knew the hub had started admitting it:
    /// the hub's HTTP/2 preface (sent once admission began) or, over QUIC,
    /// its first stream. With the diagnosis answer as the end, a span
    /// inside the hub's own admission window, so the agents' spans show,
    /// from outside the hub, how many tunnels it set up at once.
    setup_started: std::time::Instant,
}

/// A tunnel set up beside the one in use (a better transport, a renewed
/// certificate): the first of `order` the hub admits, reported to the
/// session that asked (`None` when none worked).
async fn dial_new_tunnel(
    config: AgentConfig,
    creds: Credentials,
    order: Vec<TransportKind>,
    quic: Arc<Dialers>,
    to: tokio::sync::mpsc::Sender<Option<Admitted>>,
) {
    for kind in order {
        if let Ok(admitted) = dial_admitted(&config, &creds, kind, &quic).await {
            let _ = to.send(Some(admitted)).await;
            return;
        }
    }
    let _ = to.send(None).await;
}

/// Dials over `kind` and waits (bounded) for the hub to admit the tunnel:
/// it opens the first stream once it has (the diagnosis request), or closes
/// the connection with a reason (a paced refusal carries its hint).
async fn dial_admitted(
    config: &AgentConfig,
    creds: &Credentials,
    kind: TransportKind,
    quic: &Dialers,
) -> Result<Admitted> {
    let mut acceptor = dial(config, creds, kind, quic).await?;
    // HTTP/2 (also inside WebSocket) is dialled once the hub's preface came.
    let preface = std::time::Instant::now();
    let limit = config.connect_timeout;
    match tokio::time::timeout(limit, acceptor.accept_dyn()).await {
        Ok(Ok(Some(first))) => Ok(Admitted {
            acceptor,
            first,
            setup_started: match kind {
                TransportKind::Quic => std::time::Instant::now(),
                _ => preface,
            },
        }),
        Ok(Ok(None)) => Err(AgentError::Connect(
            "the hub closed the tunnel before admitting it".into(),
        )),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(AgentError::Connect(format!(
            "the hub did not admit the tunnel within {limit:?}"
        ))),
    }
}

/// Object-safe view of the two acceptors.
trait AcceptorDyn: Send {
    fn accept_dyn(
        &mut self,
    ) -> otter_tunnel::transport::BoxFuture<
        '_,
        otter_tunnel::Result<Option<otter_tunnel::TunnelStream>>,
    >;
    fn kind_dyn(&self) -> TransportKind;
    fn packets_dyn(&self) -> Option<otter_tunnel::PathCounts>;
}

impl<A: Acceptor> AcceptorDyn for A {
    fn accept_dyn(
        &mut self,
    ) -> otter_tunnel::transport::BoxFuture<
        '_,
        otter_tunnel::Result<Option<otter_tunnel::TunnelStream>>,
    > {
        self.accept()
    }
    fn kind_dyn(&self) -> TransportKind {
        self.kind()
    }
    fn packets_dyn(&self) -> Option<otter_tunnel::PathCounts> {
        self.packets()
    }
}

/// What every dial of the agent's life shares: one QUIC endpoint, and the
/// TLS sessions of its tunnels, so a tunnel dialled again resumes its
/// session (the hub's tickets outlive a restart of the hub) instead of
/// making a full handshake.
#[derive(Debug, Default)]
pub struct Dialers {
    quic: quic::Dialer,
    sessions: std::sync::Mutex<Sessions>,
    /// Since when QUIC dials have failed (none while the last one worked):
    /// the next one first checks that the hub is there at all (see
    /// [`port_refuses`]), for at most [`QUIC_SKIPS_FOR`].
    quic_failing_since: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// The TLS of one client certificate and hub trust, per transport, with
/// its session cache. rustls resumes a session only with the very
/// verifier and certificate of the config that made it, so every dial
/// takes a clone of the one config; a renewed certificate, or a new CA
/// bundle, starts afresh.
#[derive(Debug, Default)]
struct Sessions {
    /// (hub trust PEM, client certificate PEM) of the configs kept.
    made_for: (String, String),
    by_transport: std::collections::HashMap<TransportKind, rustls::ClientConfig>,
}

/// Sessions kept per transport (a few hub names, a few tickets each).
const SESSIONS_KEPT: usize = 8;

impl Dialers {
    /// The client TLS for `kind`, with `alpn`, sharing its sessions with
    /// every earlier dial of the same certificate and trust.
    fn tls(
        &self,
        trust: &str,
        creds: &Credentials,
        kind: TransportKind,
        alpn: &[u8],
    ) -> Result<rustls::ClientConfig> {
        let mut s = lock(&self.sessions);
        if s.made_for.0 != trust || s.made_for.1 != creds.cert_pem {
            *s = Sessions {
                made_for: (trust.to_owned(), creds.cert_pem.clone()),
                by_transport: Default::default(),
            };
        }
        if let Some(tls) = s.by_transport.get(&kind) {
            return Ok(tls.clone());
        }
        let mut tls = tls::client_config(trust, Some((&creds.cert_pem, &creds.key_pem)), &[alpn])?;
        tls.resumption = rustls::client::Resumption::in_memory_sessions(SESSIONS_KEPT);
        s.by_transport.insert(kind, tls.clone());
        Ok(tls)
    }
}

async fn dial(
    config: &AgentConfig,
    creds: &Credentials,
    kind: TransportKind,
    dialers: &Dialers,
) -> Result<Box<dyn AcceptorDyn>> {
    let url = tunnel_url(&creds.tunnel_urls, kind, &config.hub_url)?;
    let (host, addr) = resolve(&url).await?;
    let client =
        |alpn: &[u8]| dialers.tls(enroll::hub_trust(config, Some(creds)), creds, kind, alpn);
    let proxy = config
        .proxy
        .as_ref()
        .filter(|p| !p.bypass(&host, addr.port()));
    let h2_settings = H2Settings {
        keepalive: config.keepalive,
        connect_timeout: config.connect_timeout,
        ..Default::default()
    };
    let server_name = || {
        rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| AgentError::Config(format!("tunnel host {host}: {e}")))
    };
    // TCP to the hub, or through the proxy.
    let tcp = async || -> Result<Box<dyn otter_tunnel::h2::Io>> {
        let connect = otter_tunnel::proxy::tcp(&host, addr.port(), addr, proxy);
        let (tcp, _) = tokio::time::timeout(config.connect_timeout, connect)
            .await
            .map_err(|_| {
                AgentError::Connect(format!("TCP connect to {host}:{} timed out", addr.port()))
            })??;
        Ok(tcp)
    };
    match kind {
        TransportKind::Quic => {
            if let Some(p) = proxy {
                return Err(AgentError::Connect(format!(
                    "QUIC skipped: traffic goes through the proxy {}",
                    p.display()
                )));
            }
            let settings = QuicSettings {
                keepalive: config.keepalive,
                connect_timeout: config.connect_timeout,
                ..Default::default()
            };
            // A QUIC try spends a session ticket even when nothing answers,
            // and a client holds only the few the hub sent: while the hub is
            // down the try is skipped, so the ticket is still there to
            // resume with when it is back. Down is what the address dialled
            // says (the hub serves TCP on its tunnel port too), not the API
            // URL the agent was given first: that one may be a replica gone
            // for good while this address is another that lives (agents
            // waited on a dead replica's API port and never dialled the
            // survivor). And only for a while, so a path where TCP is
            // refused and UDP is not still gets QUIC tried.
            let failing_since = *lock(&dialers.quic_failing_since);
            if failing_since.is_some_and(|t| t.elapsed() < QUIC_SKIPS_FOR)
                && port_refuses(addr).await
            {
                return Err(AgentError::Connect(format!(
                    "QUIC not tried: the hub's tunnel port {addr} refuses TCP connections (the hub is down?)"
                )));
            }
            let dialed = dialers
                .quic
                .dial(addr, &host, client(quic::ALPN)?, &settings)
                .await;
            let mut since = lock(&dialers.quic_failing_since);
            *since = match &dialed {
                Ok(_) => None,
                Err(_) => Some(since.unwrap_or_else(tokio::time::Instant::now)),
            };
            drop(since);
            Ok(Box::new(dialed?))
        }
        TransportKind::H2 => {
            let tls = Arc::new(client(h2::ALPN)?);
            Ok(Box::new(
                h2::dial_tcp(tcp().await?, server_name()?, tls, h2_settings).await?,
            ))
        }
        TransportKind::Ws => {
            let tls = Arc::new(client(otter_tunnel::ws::ALPN)?);
            let tcp = tcp().await?;
            Ok(Box::new(
                otter_tunnel::ws::dial_tcp(tcp, addr.port(), server_name()?, tls, h2_settings)
                    .await?,
            ))
        }
        TransportKind::Mem => Err(AgentError::Config(
            "the in-memory transport is for tests".into(),
        )),
    }
}

/// Failed dial rounds in a row, over at least this long, after which the
/// agent asks the hub for its tunnel URLs again (a renewal) if the hub's
/// API answers; and how often it does at most.
const URL_REFRESH_ROUNDS: u32 = 3;
const URL_REFRESH_AFTER: Duration = Duration::from_secs(10);
const URL_REFRESH_EVERY: Duration = Duration::from_secs(60);

/// Whether one of the hub's API URLs takes a TCP connection (through the
/// proxy when one applies), all asked at once, bounded by a few seconds.
/// Any of them, not only the first: Register and renewals take the first
/// that answers, and an agent whose first `--hub-url` was the replica that
/// went away, holding only that replica's tunnel URLs, would otherwise
/// never ask another replica where tunnels are served now.
async fn api_reachable(config: &AgentConfig) -> bool {
    use futures::StreamExt;
    let mut asked: futures::stream::FuturesUnordered<_> = config
        .hub_urls()
        .map(|url| api_port_takes(config, url))
        .collect();
    let any = async {
        while let Some(took) = asked.next().await {
            if took {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(Duration::from_secs(5), any)
        .await
        .unwrap_or(false)
}

async fn api_port_takes(config: &AgentConfig, url: &Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = url.port_or_known_default().unwrap_or(443);
    enroll::dial_tcp(host, port, config.proxy.as_ref())
        .await
        .is_ok()
}

/// Whether `addr` refuses TCP connections outright (a reset: nothing
/// listens there, so the hub is down). A silent port says nothing, and
/// counts as no.
async fn port_refuses(addr: std::net::SocketAddr) -> bool {
    let connect = tokio::net::TcpStream::connect(addr);
    matches!(
        tokio::time::timeout(Duration::from_secs(2), connect).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// How long after QUIC dials started failing they are skipped while the
/// hub's tunnel port refuses TCP: a hub's restart, not a path that serves
/// UDP alone.
const QUIC_SKIPS_FOR: Duration = Duration::from_secs(60);

/// `m` locked; a panic elsewhere while it was held left nothing half done.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The hub's default tunnel port, when nothing says where to dial.
pub(crate) const DEFAULT_TUNNEL_PORT: u16 = 8444;

/// Where to dial `kind`: the URL the hub listed for it; else, as the hub
/// serves every transport on its one tunnel port, the host and port of
/// another URL it listed; else the API URL's host on the default tunnel
/// port. So an agent limited to a transport the hub no longer lists but
/// still accepts is not stranded.
fn tunnel_url(listed: &[Url], kind: TransportKind, hub_url: &Url) -> Result<Url> {
    if let Some(u) = listed
        .iter()
        .find(|u| u.scheme().parse::<TransportKind>().ok() == Some(kind))
    {
        return Ok(u.clone());
    }
    let (host, port) = listed
        .iter()
        .find_map(|u| Some((u.host_str()?.to_owned(), u.port()?)))
        .or_else(|| Some((hub_url.host_str()?.to_owned(), DEFAULT_TUNNEL_PORT)))
        .ok_or_else(|| AgentError::Config(format!("hub URL {hub_url} has no host")))?;
    let scheme = match kind {
        TransportKind::Quic => "quic",
        TransportKind::H2 => "h2",
        _ => "wss",
    };
    Url::parse(&format!("{scheme}://{host}:{port}"))
        .map_err(|e| AgentError::Config(format!("{scheme} tunnel URL for {host}: {e}")))
}

async fn resolve(url: &Url) -> Result<(String, SocketAddr)> {
    let host = url
        .host_str()
        .ok_or_else(|| AgentError::Config(format!("tunnel URL {url} has no host")))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url
        .port()
        .ok_or_else(|| AgentError::Config(format!("tunnel URL {url} has no port")))?;
    let addr = tokio::net::lookup_host((host.as_str(), port))
        .await?
        .next()
        .ok_or_else(|| AgentError::Connect(format!("{host} does not resolve")))?;
    Ok((host, addr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use TransportKind::{H2, Quic, Ws};

    #[test]
    fn a_renewal_that_failed_short_of_a_refusal_is_reported_over_the_spent_token() {
        let spent = || {
            AgentError::Register(tonic::Status::unauthenticated(
                "join token was already used",
            ))
        };
        let out_of_reach = || AgentError::Connect("connection refused".into());
        assert!(matches!(
            reported_error(Some(out_of_reach()), spent()),
            AgentError::Connect(_)
        ));
        let failed = AgentError::Register(tonic::Status::unavailable("store unavailable"));
        let reported = reported_error(Some(failed), spent()).to_string();
        assert!(reported.contains("store"), "{reported}");
        // A refused renewal: the join token was the way, its answer stands.
        let replaced = AgentError::Register(tonic::Status::permission_denied(
            "this certificate's agent has been replaced; register with a join token",
        ));
        let reported = reported_error(Some(replaced), spent()).to_string();
        assert!(reported.contains("already used"), "{reported}");
        // No renewal (a first enrollment): the enrollment's own error.
        let reported = reported_error(None, spent()).to_string();
        assert!(reported.contains("already used"), "{reported}");
        // A busy hub's answer keeps its hint, so the agent comes back when
        // told and not after its backoff.
        let mut busy = tonic::Status::unavailable("registrations are paced");
        busy.metadata_mut().insert(
            otter_tunnel::pace::GRPC_RETRY_AFTER_MS,
            "1500".parse().expect("ascii"),
        );
        let kept = reported_error(Some(out_of_reach()), AgentError::Register(busy));
        assert_eq!(kept.retry_after(), Some(Duration::from_millis(1500)));
    }

    /// The hub names the URLs to dial next (in a diagnosis header, in a
    /// stopping replica's goodbye): only tunnel URLs with a host are kept,
    /// and no more than [`MAX_ADVERTISED_URLS`] of them, whatever it sends.
    /// (Each is dialled like any other: the hub CA is checked there too.)
    #[test]
    fn urls_the_hub_names_are_kept_only_when_dialable() {
        let named = [
            " quic://b.example:8444 ",
            "h2://[::1]:8444",
            "wss://b.example",
            "http://b.example:80",
            "file:///etc/passwd",
            "unix:/run/otter.sock",
            "quic:no-host",
            "not a url",
            "",
        ];
        let kept: Vec<String> = dialable(named.into_iter())
            .iter()
            .map(Url::to_string)
            .collect();
        assert_eq!(
            kept,
            [
                "quic://b.example:8444",
                "h2://[::1]:8444",
                "wss://b.example/"
            ]
        );
        let many: Vec<String> = (0..100)
            .map(|i| format!("quic://r{i}.example:8444"))
            .collect();
        let kept = dialable(many.iter().map(String::as_str));
        assert_eq!(kept.len(), MAX_ADVERTISED_URLS);
        assert_eq!(kept[0].host_str(), Some("r0.example"));
    }

    #[test]
    fn replicas_urls_are_dialled_one_replica_at_a_time_round_and_round() {
        let urls: Vec<Url> = [
            "quic://a.example:8444",
            "h2://a.example:8444",
            "ws://a.example:443",
            "quic://b.example:8444",
            "h2://b.example:8444",
        ]
        .iter()
        .map(|u| Url::parse(u).unwrap())
        .collect();
        let groups = sites(&urls);
        assert_eq!(groups.len(), 3, "{groups:?}");
        assert_eq!(groups[0], urls[..2].to_vec());
        assert_eq!(groups[2], urls[3..].to_vec());
        assert!(sites(&[]).is_empty());
    }

    #[test]
    fn a_transport_the_hub_does_not_list_is_dialled_on_its_tunnel_port() {
        let api: Url = "https://hub.example:8443".parse().unwrap();
        let listed: Vec<Url> = ["quic://t.example:9444", "h2://t.example:9444"]
            .iter()
            .map(|u| u.parse().unwrap())
            .collect();
        let url = |k| tunnel_url(&listed, k, &api).unwrap().to_string();
        assert_eq!(url(Quic), "quic://t.example:9444");
        assert_eq!(url(Ws), "wss://t.example:9444/");
        // Nothing listed: the API host on the default tunnel port.
        assert_eq!(
            tunnel_url(&[], H2, &api).unwrap().to_string(),
            "h2://hub.example:8444"
        );
    }

    #[test]
    fn the_last_good_transport_goes_first_and_better_ones_are_known() {
        let all = [Quic, H2, Ws];
        assert_eq!(dial_order(&all, None), [Quic, H2, Ws]);
        assert_eq!(dial_order(&all, Some(Ws)), [Ws, Quic, H2]);
        assert_eq!(dial_order(&[Quic, H2], Some(Ws)), [Quic, H2]);
        assert_eq!(better_than(&all, Ws), [Quic, H2]);
        assert_eq!(better_than(&all, Quic), []);
        let mut config = AgentConfig::new(
            "https://hub:1".parse().unwrap(),
            "c",
            "a",
            "unused in this test",
        );
        assert!(next_probe(&config, Quic).is_none(), "already the best");
        assert!(next_probe(&config, H2).is_some());
        config.transport_retry = Duration::ZERO;
        assert!(next_probe(&config, H2).is_none(), "switched off");
    }
}
