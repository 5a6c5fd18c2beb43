//! `otter-agent doctor`: why this agent can or cannot reach its hub, one
//! line a check, each with its verdict and, when it fails, the fix. It
//! uses the agent's own settings (hub URLs, CAs, proxy, kept identity) and
//! needs no tool in the container.
//!
//! Checks, in the order a connection needs them: the hub's names resolve;
//! the proxy, when one applies; the API port answers over TCP and shows a
//! certificate this agent trusts; the tunnel port the same, against the
//! pinned hub CA (a certificate from elsewhere there means something on the
//! way re-signs TLS); QUIC gets an answer over UDP; the clocks agree; and
//! the agent has something to join or reconnect with.

use std::{error::Error as _, sync::Arc, time::Duration};

use otter_pki::tls;
use otter_tunnel::{h2::Io, reach::CaHint};
use tokio_rustls::TlsConnector;
use url::Url;

use crate::{AgentConfig, enroll};

/// Bound of each network check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// A clock this far from the hub's is reported: certificates are
/// backdated by [`otter_pki::ca::CLOCK_SKEW`], renewals follow the hub's
/// clock, but logs and expiries read wrong.
const SKEW_WARN_SECS: i64 = 60;

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Works, with something to know (a fallback taken, a clock a little off).
    Warn,
    Fail,
    /// Does not apply here (QUIC through a proxy, say).
    Skip,
}

impl Verdict {
    /// The verdict as printed: `ok`, `warn`, `FAIL`, `skip`.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "skip",
        }
    }
}

/// One check's line.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    /// What was found, and for a failure what to do.
    pub detail: String,
}

impl Check {
    fn new(name: &'static str, verdict: Verdict, detail: impl Into<String>) -> Check {
        Check {
            name,
            verdict,
            detail: detail.into(),
        }
    }
}

/// The checks' lines, aligned.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    checks
        .iter()
        .map(|c| {
            format!(
                "{:<4}  {:<width$}  {}\n",
                c.verdict.word(),
                c.name,
                c.detail
            )
        })
        .collect()
}

/// Runs every check with `config` and the identity it keeps, if any.
pub async fn run(config: &AgentConfig) -> Vec<Check> {
    let creds = match &config.state {
        Some(store) => store.load(config.clock.now()).await.ok().flatten(),
        None => None,
    };
    run_with(config, creds).await
}

/// Runs every check with `config` and `creds` (what a running agent
/// holds: its certificate and the tunnel URLs the hub gave it).
pub async fn run_with(config: &AgentConfig, creds: Option<enroll::Credentials>) -> Vec<Check> {
    let mut checks = Vec::new();
    let api = &config.hub_url;
    let Some((api_host, api_port)) = host_port(api) else {
        checks.push(Check::new(
            "hub-url",
            Verdict::Fail,
            format!("{api} has no host: give --hub-url https://HOST[:PORT]"),
        ));
        return checks;
    };
    let tunnel_urls = creds.as_ref().map_or(&[][..], |c| &c.tunnel_urls[..]);
    let tcp_tunnel = tunnel_urls
        .iter()
        .find(|u| matches!(u.scheme(), "h2" | "wss"))
        .and_then(host_port)
        .unwrap_or_else(|| (api_host.clone(), crate::tunnel::DEFAULT_TUNNEL_PORT));
    let quic_tunnel = tunnel_urls
        .iter()
        .find(|u| u.scheme() == "quic")
        .and_then(host_port)
        .unwrap_or_else(|| tcp_tunnel.clone());

    // Names.
    let mut names = vec![(api_host.clone(), api_port), tcp_tunnel.clone()];
    names.dedup_by(|a, b| a.0 == b.0);
    for (host, port) in &names {
        checks.push(dns(host, *port).await);
    }

    // The proxy, where one applies to the hub.
    let proxy = config
        .proxy
        .as_ref()
        .filter(|p| !p.bypass(&api_host, api_port));
    checks.push(match (&config.proxy, proxy) {
        (None, _) => Check::new(
            "proxy",
            Verdict::Ok,
            "none: connections to the hub go direct",
        ),
        (Some(p), None) => Check::new(
            "proxy",
            Verdict::Ok,
            format!("{} is not used for the hub (NO_PROXY)", p.display()),
        ),
        (Some(p), Some(_)) => Check::new(
            "proxy",
            Verdict::Ok,
            format!("{}: CONNECT through it below", p.display()),
        ),
    });

    // The API port: TCP, then TLS with the API's trust.
    let api_tls = tls::api_client_config(
        enroll::hub_trust(config, creds.as_ref()),
        config.api_trust.ca_pem.as_deref(),
        config.api_trust.public_roots,
        None,
        &[b"http/1.1"],
    );
    let api_stream = match api_tls {
        Ok(tls) => {
            let (tcp, tls_check, stream) = reach(
                config,
                ("api-tcp", "api-tls"),
                (&api_host, api_port),
                tls,
                CaHint("the manifest's hub CA, --hub-ca-file (or --hub-api-ca-file)"),
            )
            .await;
            checks.push(tcp);
            checks.extend(tls_check);
            stream
        }
        Err(e) => {
            checks.push(Check::new(
                "api-tls",
                Verdict::Fail,
                format!("the hub CA does not load: {e}"),
            ));
            None
        }
    };
    checks.push(match api_stream {
        Some(stream) => clock(config, stream, &api_host).await,
        None => Check::new(
            "clock",
            Verdict::Skip,
            "not measured: the API did not answer",
        ),
    });

    // The tunnel port over TCP, against the pinned hub CA.
    match tls::client_config(
        enroll::hub_trust(config, creds.as_ref()),
        None,
        &[otter_tunnel::h2::ALPN],
    ) {
        Ok(tls) => {
            let (tcp, tls_check, _) = reach(
                config,
                ("tunnel-tcp", "tunnel-tls"),
                (&tcp_tunnel.0, tcp_tunnel.1),
                tls,
                CaHint("the manifest's hub CA, --hub-ca-file"),
            )
            .await;
            checks.push(tcp);
            checks.extend(tls_check.map(|mut c| {
                // The hub CA verifies the hub everywhere; a certificate from
                // another CA on the tunnel port is not the hub's.
                if c.verdict == Verdict::Fail
                    && (c.detail.contains("not from a CA trusted here")
                        || c.detail.contains("UnknownIssuer"))
                {
                    c.detail = format!(
                        "the tunnel port shows a certificate that is not from the pinned hub CA: \
                         something on the way re-signs TLS (a middlebox inspecting it); let the \
                         tunnel port through without inspection, or check --hub-ca-file ({})",
                        c.detail
                    );
                }
                c
            }));
        }
        Err(e) => checks.push(Check::new(
            "tunnel-tls",
            Verdict::Fail,
            format!("the hub CA does not load: {e}"),
        )),
    }

    // QUIC over UDP, where it may be tried at all.
    checks.push(if !config.transports.contains(&otter_tunnel::TransportKind::Quic) {
        Check::new("quic", Verdict::Skip, "not among --transports")
    } else if proxy.is_some() {
        Check::new(
            "quic",
            Verdict::Skip,
            "not tried through a proxy (UDP does not go through CONNECT); the tunnel uses TLS + HTTP/2",
        )
    } else {
        quic(config, &quic_tunnel).await
    });
    // How large a datagram gets through, once QUIC is known to answer.
    let quic_answers = checks.last().is_some_and(|c| c.verdict == Verdict::Ok);
    checks.push(if quic_answers {
        path_mtu(&quic_tunnel).await
    } else {
        Check::new(
            "path-mtu",
            Verdict::Skip,
            "not measured: QUIC is not tried or got no answer (see quic)",
        )
    });

    // Something to join or reconnect with.
    checks.push(match &creds {
        Some(c) => {
            let left = c.not_after - config.clock.now();
            Check::new(
                "identity",
                Verdict::Ok,
                format!(
                    "certificate {} of agent {} valid for another {}",
                    c.serial,
                    c.agent_id,
                    human(left)
                ),
            )
        }
        None if !config.join_token.0.is_empty() => Check::new(
            "identity",
            Verdict::Ok,
            "a join token (it enrolls this cluster once, before it expires)",
        ),
        None => Check::new(
            "identity",
            Verdict::Fail,
            format!(
                "no join token and no kept certificate: apply a fresh manifest (`otter agent-manifest --cluster {}`)",
                config.cluster
            ),
        ),
    });
    checks
}

fn host_port(url: &Url) -> Option<(String, u16)> {
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url
        .port_or_known_default()
        .unwrap_or(crate::tunnel::DEFAULT_TUNNEL_PORT);
    Some((host, port))
}

async fn dns(host: &str, port: u16) -> Check {
    match tokio::time::timeout(CHECK_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addrs)) => {
            let mut addrs: Vec<String> = addrs.map(|a| a.ip().to_string()).collect();
            addrs.dedup();
            Check::new(
                "dns",
                Verdict::Ok,
                format!("{host} is {}", addrs.join(", ")),
            )
        }
        Ok(Err(e)) => Check::new(
            "dns",
            Verdict::Fail,
            format!(
                "{host} does not resolve ({e}): check the name in --hub-url and the cluster's DNS"
            ),
        ),
        Err(_) => Check::new(
            "dns",
            Verdict::Fail,
            format!(
                "no answer for {host} within {} s: the cluster's DNS does not answer",
                CHECK_TIMEOUT.as_secs()
            ),
        ),
    }
}

/// TCP (through the proxy where one applies) and TLS to `host:port`;
/// returns the two checks and, when both passed, the TLS stream.
async fn reach(
    config: &AgentConfig,
    (tcp_name, tls_name): (&'static str, &'static str),
    (host, port): (&str, u16),
    tls: rustls::ClientConfig,
    ca: CaHint<'_>,
) -> (
    Check,
    Option<Check>,
    Option<tokio_rustls::client::TlsStream<Box<dyn Io>>>,
) {
    let via = config
        .proxy
        .as_ref()
        .filter(|p| !p.bypass(host, port))
        .map(|p| format!(" through {}", p.display()))
        .unwrap_or_default();
    let io = match tokio::time::timeout(
        CHECK_TIMEOUT,
        enroll::dial_tcp(host, port, config.proxy.as_ref()),
    )
    .await
    {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => {
            let why = otter_tunnel::reach::why_unreachable(&e, host, port, ca)
                .unwrap_or_else(|| otter_tunnel::error_chain(&e));
            return (
                Check::new(
                    tcp_name,
                    Verdict::Fail,
                    format!("{host}:{port}{via}: {why}"),
                ),
                None,
                None,
            );
        }
        Err(_) => {
            return (
                Check::new(
                    tcp_name,
                    Verdict::Fail,
                    format!(
                        "{host}:{port}{via}: no answer within {} s: a firewall drops the connection, or the port is wrong",
                        CHECK_TIMEOUT.as_secs()
                    ),
                ),
                None,
                None,
            );
        }
    };
    let tcp = Check::new(tcp_name, Verdict::Ok, format!("{host}:{port}{via} answers"));
    let Ok(name) = rustls::pki_types::ServerName::try_from(host.to_owned()) else {
        return (
            tcp,
            Some(Check::new(
                tls_name,
                Verdict::Fail,
                format!("{host} is not a valid TLS name"),
            )),
            None,
        );
    };
    let handshake = TlsConnector::from(Arc::new(tls)).connect(name, io);
    match tokio::time::timeout(CHECK_TIMEOUT, handshake).await {
        Ok(Ok(stream)) => (
            tcp,
            Some(Check::new(tls_name, Verdict::Ok, "certificate verified")),
            Some(stream),
        ),
        Ok(Err(e)) => {
            let why = otter_tunnel::reach::why_unreachable(&e, host, port, ca)
                .unwrap_or_else(|| otter_tunnel::error_chain(&e));
            (tcp, Some(Check::new(tls_name, Verdict::Fail, why)), None)
        }
        Err(_) => (
            tcp,
            Some(Check::new(
                tls_name,
                Verdict::Fail,
                format!(
                    "no TLS answer within {} s: something holds the connection without speaking TLS",
                    CHECK_TIMEOUT.as_secs()
                ),
            )),
            None,
        ),
    }
}

/// The hub's clock from its HTTP `Date` header (one `GET /healthz`),
/// against this agent's.
async fn clock(
    config: &AgentConfig,
    stream: tokio_rustls::client::TlsStream<Box<dyn Io>>,
    host: &str,
) -> Check {
    let ask = async {
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = http::Request::get("/healthz")
            .header(http::header::HOST, host)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .expect("static request");
        send.send_request(req).await
    };
    let resp = match tokio::time::timeout(CHECK_TIMEOUT, ask).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return Check::new(
                "clock",
                Verdict::Skip,
                format!("the hub did not answer over HTTP: {e}"),
            );
        }
        Err(_) => return Check::new("clock", Verdict::Skip, "the hub did not answer over HTTP"),
    };
    let Some(hub_now) = resp
        .headers()
        .get(http::header::DATE)
        .and_then(|v| v.to_str().ok())
        .and_then(httpdate_secs)
    else {
        return Check::new("clock", Verdict::Skip, "the hub's answer has no Date");
    };
    let ahead = config.clock.now() - hub_now;
    // The Date header has whole seconds: a second either way is rounding.
    match ahead.abs() {
        0..=2 => Check::new("clock", Verdict::Ok, "agrees with the hub's"),
        s if s < SKEW_WARN_SECS => Check::new(
            "clock",
            Verdict::Ok,
            format!(
                "{s}s {} the hub's (renewals follow the hub's clock)",
                if ahead > 0 { "ahead of" } else { "behind" }
            ),
        ),
        s => Check::new(
            "clock",
            if s < otter_pki::ca::CLOCK_SKEW.as_secs() as i64 {
                Verdict::Warn
            } else {
                Verdict::Fail
            },
            format!(
                "{} {} the hub's: set the time (NTP); certificates read as not yet or no longer valid past {}",
                human(s),
                if ahead > 0 { "ahead of" } else { "behind" },
                human(otter_pki::ca::CLOCK_SKEW.as_secs() as i64)
            ),
        ),
    }
}

/// An HTTP date (`Wed, 02 Dec 2026 08:30:05 GMT`) as Unix seconds.
fn httpdate_secs(v: &str) -> Option<i64> {
    let format = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    time::PrimitiveDateTime::parse(v, format)
        .ok()
        .map(|t| t.assume_utc().unix_timestamp())
}

/// Datagram sizes the path MTU check sends, smallest first: QUIC's minimum
/// (every client Initial is padded to it), common sizes of tunnelled and
/// PPPoE paths, and what an IPv4 path of 1,500 bytes carries. Larger
/// datagrams are the tunnel's own path MTU search's business: a path that
/// carries no more than this is the Internet's norm, not a fault.
const MTU_PROBES: [usize; 6] = [1200, 1280, 1350, 1400, 1452, 1472];

/// Tries per probe size before it counts as not passing.
const MTU_TRIES: usize = 3;

/// How long one probe waits for its answer.
const MTU_WAIT: Duration = Duration::from_millis(300);

/// The largest UDP datagram that reaches the tunnel port and is answered.
/// Each probe is a QUIC long-header packet of an unknown version, which a
/// QUIC server must answer with a Version Negotiation packet when the
/// datagram holds at least 1,200 bytes (RFC 9000 §6): no handshake, no
/// state on the hub, nothing that looks like a tunnel.
async fn path_mtu((host, port): &(String, u16)) -> Check {
    let check = |verdict, detail: String| Check::new("path-mtu", verdict, detail);
    let addr = match tokio::net::lookup_host((host.as_str(), *port)).await {
        Ok(mut a) => match a.next() {
            Some(a) => a,
            None => return check(Verdict::Skip, format!("{host} has no address")),
        },
        Err(_) => return check(Verdict::Skip, format!("{host} does not resolve")),
    };
    let local: std::net::SocketAddr = match addr {
        std::net::SocketAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
        std::net::SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = match tokio::net::UdpSocket::bind(local).await {
        Ok(s) if s.connect(addr).await.is_ok() => s,
        _ => return check(Verdict::Skip, "no UDP socket to probe with".to_owned()),
    };
    let mut largest = None;
    for size in MTU_PROBES {
        if !answered_at(&socket, size).await {
            break;
        }
        largest = Some(size);
    }
    let max = MTU_PROBES[MTU_PROBES.len() - 1];
    match largest {
        None => check(
            Verdict::Fail,
            format!(
                "QUIC answered, but {MTU_TRIES} probes of {} bytes to {host}:{port} did not: the path loses large UDP datagrams (a small MTU whose fragments are dropped, or a limit on UDP), and QUIC needs {} bytes (raise the path MTU, or use TLS + HTTP/2: --transports h2)",
                MTU_PROBES[0], MTU_PROBES[0]
            ),
        ),
        Some(n) if n == max => check(
            Verdict::Ok,
            format!("datagrams of {n} bytes reach {host}:{port}: every packet QUIC sends fits"),
        ),
        Some(n) => check(
            Verdict::Ok,
            format!(
                "datagrams of up to {n} bytes reach {host}:{port}, larger ones do not: QUIC works (it starts at 1200 bytes and finds the rest itself), with smaller packets than a {max}-byte path allows"
            ),
        ),
    }
}

/// Sends a Version-Negotiation-eliciting datagram of `size` bytes (up to
/// [`MTU_TRIES`] times) and says whether the hub answered it.
async fn answered_at(socket: &tokio::net::UdpSocket, size: usize) -> bool {
    let ids: [u8; 16] = rand::random();
    let (dcid, scid) = ids.split_at(8);
    let mut packet = Vec::with_capacity(size);
    // Long header, fixed bit; a reserved version (0x?a?a?a?a) no server
    // speaks; both connection ids; zeros up to the size.
    packet.push(0xc0);
    packet.extend_from_slice(&[0x1a, 0x2a, 0x3a, 0x4a]);
    packet.push(8);
    packet.extend_from_slice(dcid);
    packet.push(8);
    packet.extend_from_slice(scid);
    packet.resize(size, 0);
    let mut buf = [0u8; 2048];
    for _ in 0..MTU_TRIES {
        if socket.send(&packet).await.is_err() {
            return false;
        }
        let deadline = tokio::time::Instant::now() + MTU_WAIT;
        while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, socket.recv(&mut buf)).await {
            // Version Negotiation: version 0, sent to our source id.
            let answer = &buf[..n];
            if n >= 15
                && answer[0] & 0x80 != 0
                && answer[1..5] == [0, 0, 0, 0]
                && answer[5] == 8
                && &answer[6..14] == scid
            {
                return true;
            }
        }
    }
    false
}

/// Whether a QUIC dial ended because the port's host refused its
/// datagrams: no answer from a QUIC endpoint, so not "UDP gets through".
fn refused_udp(e: &otter_tunnel::TunnelError) -> bool {
    matches!(e, otter_tunnel::TunnelError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// ALPN the QUIC check offers: one the hub does not speak, so the hub ends
/// the handshake while answering the first packet (an alert in place of
/// its certificate: a key exchange, no signature). The check needs only
/// that answer; a
/// handshake that went through with the agent's certificate was admitted
/// as a tunnel and replaced the agent's own (in a reconnect storm, where
/// the doctor runs after a few failed rounds, the hub closed live tunnels
/// "replaced by a newer tunnel from the same agent").
const CHECK_ALPN: &[u8] = b"otter-doctor-udp-check";

/// A QUIC handshake with the tunnel port, ended by the hub: any answer
/// shows UDP gets through.
async fn quic(config: &AgentConfig, (host, port): &(String, u16)) -> Check {
    let addr = match tokio::net::lookup_host((host.as_str(), *port)).await {
        Ok(mut a) => match a.next() {
            Some(a) => a,
            None => return Check::new("quic", Verdict::Skip, format!("{host} has no address")),
        },
        Err(_) => return Check::new("quic", Verdict::Skip, format!("{host} does not resolve")),
    };
    let tls = match tls::client_config(enroll::hub_trust(config, None), None, &[CHECK_ALPN]) {
        Ok(t) => t,
        Err(e) => {
            return Check::new(
                "quic",
                Verdict::Fail,
                format!("the hub CA does not load: {e}"),
            );
        }
    };
    let settings = otter_tunnel::quic::QuicSettings {
        connect_timeout: CHECK_TIMEOUT,
        ..Default::default()
    };
    let dial = otter_tunnel::quic::dial(addr, host, tls, &settings);
    let blocked = || {
        Check::new(
            "quic",
            Verdict::Warn,
            format!(
                "no answer over UDP from {host}:{port} within {} s: UDP to the tunnel port is blocked, or datagrams of 1200 bytes (QUIC's minimum) do not pass; the agent falls back to TLS + HTTP/2 (let UDP {port} out for QUIC)",
                CHECK_TIMEOUT.as_secs()
            ),
        )
    };
    let answers = || {
        Check::new(
            "quic",
            Verdict::Ok,
            format!("{host}:{port} answers over UDP"),
        )
    };
    match tokio::time::timeout(CHECK_TIMEOUT + Duration::from_secs(1), dial).await {
        // Something there took the check's protocol: not the hub, but UDP
        // gets through.
        Ok(Ok(_)) => answers(),
        Ok(Err(e)) if refused_udp(&e) => Check::new(
            "quic",
            Verdict::Warn,
            format!(
                "{host}:{port} refuses UDP (ICMP port unreachable): nothing listens on that UDP port, or a firewall rejects it; the agent falls back to TLS + HTTP/2 (open UDP {port} on the hub for QUIC)"
            ),
        ),
        Ok(Err(e)) => {
            let text = otter_tunnel::error_chain(&e);
            if text.contains("timed out") || e.source().is_none() && text.contains("timeout") {
                blocked()
            } else {
                answers()
            }
        }
        Err(_) => blocked(),
    }
}

fn human(secs: i64) -> String {
    match secs {
        s if s < 0 => format!("-{}", human(-s)),
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP port nothing listens on answers with ICMP port unreachable:
    /// the check says so (at once), not that UDP gets through.
    #[tokio::test]
    async fn quic_to_a_closed_port_is_called_refused() {
        otter_pki::tls::install_default_provider();
        let ca = otter_pki::CertificateAuthority::generate("doctor test CA").unwrap();
        let config = AgentConfig::new(
            "https://localhost:1".parse().unwrap(),
            "edge-1",
            "a1",
            ca.cert_pem(),
        );
        let closed = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let check = quic(&config, &("127.0.0.1".to_owned(), closed)).await;
        assert_eq!(check.verdict, Verdict::Warn, "{}", check.detail);
        assert!(check.detail.contains("refuses UDP"), "{}", check.detail);
    }

    #[test]
    fn http_dates_parse() {
        assert_eq!(httpdate_secs("Thu, 01 Jan 1970 00:01:40 GMT"), Some(100));
        assert_eq!(httpdate_secs("yesterday"), None);
    }

    #[test]
    fn lines_align_with_their_verdicts() {
        let text = render(&[
            Check::new("dns", Verdict::Ok, "hub is 127.0.0.1"),
            Check::new("tunnel-tls", Verdict::Fail, "re-signed"),
        ]);
        assert_eq!(
            text,
            "ok    dns         hub is 127.0.0.1\nFAIL  tunnel-tls  re-signed\n"
        );
    }
}
