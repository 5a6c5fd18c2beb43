//! HTTP CONNECT proxies on the way out: `--proxy` or the usual
//! `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` variables, with basic auth.
//! TCP transports tunnel through the proxy; QUIC cannot and is skipped.
//! An `https://` proxy is reached over TLS first, so the CONNECT line and
//! the proxy credentials are encrypted too; the hub's own TLS then runs
//! inside that.

use std::{net::IpAddr, sync::Arc};

use base64::Engine;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};
use url::Url;

use crate::{Result, TunnelError, h2::Io};

/// Longest proxy answer head read.
const MAX_RESPONSE_HEAD: usize = 16 * 1024;

/// A proxy to dial through.
#[derive(Clone)]
pub struct Proxy {
    pub url: Url,
    no_proxy: Vec<String>,
    /// How an `https://` proxy is verified.
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL without its credentials.
        f.write_str(&self.display())
    }
}

impl Proxy {
    /// A proxy from a URL (`http[s]://[user:pass@]host:port`), with
    /// `NO_PROXY` style exceptions. An `https://` proxy also needs
    /// [`Proxy::with_tls`].
    pub fn new(url: Url, no_proxy: &str) -> Result<Self> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(TunnelError::Tls(format!(
                "proxy {}: only http:// and https:// proxies are supported",
                url.scheme()
            )));
        }
        if url.host_str().is_none() {
            return Err(TunnelError::Tls("proxy URL has no host".into()));
        }
        let no_proxy = no_proxy
            .split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect();
        Ok(Self {
            url,
            no_proxy,
            tls: None,
        })
    }

    /// The TLS client configuration an `https://` proxy is verified with
    /// (the roots it must chain to).
    pub fn with_tls(mut self, tls: Arc<rustls::ClientConfig>) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Whether the proxy itself is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.url.scheme() == "https"
    }

    /// The proxy the environment names, if any (`HTTPS_PROXY` first, then
    /// `HTTP_PROXY`, either case).
    pub fn from_env() -> Option<Result<Self>> {
        let get = |k: &str| {
            std::env::var(k)
                .ok()
                .or_else(|| std::env::var(k.to_ascii_lowercase()).ok())
                .filter(|v| !v.is_empty())
        };
        let raw = get("HTTPS_PROXY").or_else(|| get("HTTP_PROXY"))?;
        let url = if raw.contains("://") {
            raw
        } else {
            format!("http://{raw}")
        };
        let no_proxy = get("NO_PROXY").unwrap_or_default();
        Some(
            Url::parse(&url)
                .map_err(|e| TunnelError::Tls(format!("proxy URL: {e}")))
                .and_then(|u| Self::new(u, &no_proxy)),
        )
    }

    /// The URL for logs and diagnosis: credentials left out.
    pub fn display(&self) -> String {
        let mut u = self.url.clone();
        let _ = u.set_username("");
        let _ = u.set_password(None);
        u.to_string()
    }

    /// Whether `host:port` bypasses the proxy (`NO_PROXY` rules: `*`, exact
    /// host, domain suffix with or without a leading dot, IP, CIDR, and an
    /// optional `:port` on any of them).
    pub fn bypass(&self, host: &str, port: u16) -> bool {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        self.no_proxy.iter().any(|rule| {
            if rule == "*" {
                return true;
            }
            let (pattern, rule_port) = match rule.rsplit_once(':') {
                Some((p, n)) if !p.contains(':') || p.ends_with(']') => match n.parse::<u16>() {
                    Ok(n) => (p.trim_start_matches('[').trim_end_matches(']'), Some(n)),
                    Err(_) => (rule.as_str(), None),
                },
                _ => (rule.as_str(), None),
            };
            if rule_port.is_some_and(|p| p != port) {
                return false;
            }
            if let Some((net, bits)) = pattern.split_once('/') {
                return match (
                    net.parse::<IpAddr>(),
                    bits.parse::<u8>(),
                    host.parse::<IpAddr>(),
                ) {
                    (Ok(net), Ok(bits), Ok(ip)) => in_cidr(ip, net, bits),
                    _ => false,
                };
            }
            let suffix = pattern.trim_start_matches('.');
            host == suffix || host.ends_with(&format!(".{suffix}"))
        })
    }

    /// Opens a connection to `host:port` through the proxy.
    pub async fn connect(&self, host: &str, port: u16) -> Result<Box<dyn Io>> {
        let proxy_host = self
            .url
            .host_str()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let proxy_port = self.url.port_or_known_default().unwrap_or(3128);
        let tcp = TcpStream::connect((proxy_host.as_str(), proxy_port)).await?;
        let _ = tcp.set_nodelay(true);
        if !self.is_https() {
            return Ok(Box::new(self.handshake(tcp, host, port).await?));
        }
        let tls = self.tls.clone().ok_or_else(|| {
            TunnelError::Tls(format!(
                "proxy {}: no TLS settings to verify it with",
                self.display()
            ))
        })?;
        let name = rustls::pki_types::ServerName::try_from(proxy_host.clone())
            .map_err(|e| TunnelError::Tls(format!("proxy host {proxy_host}: {e}")))?;
        let tls = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .map_err(|e| TunnelError::Tls(format!("TLS to proxy {}: {e}", self.display())))?;
        Ok(Box::new(self.handshake(tls, host, port).await?))
    }

    /// Asks the proxy for a tunnel to `host:port` on `io` and reads its
    /// answer, leaving `io` at the first byte of the tunnel.
    async fn handshake<S>(&self, mut io: S, host: &str, port: u16) -> Result<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let target = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mut req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
        if !self.url.username().is_empty() {
            let user = percent_decode(self.url.username());
            let pass = percent_decode(self.url.password().unwrap_or(""));
            let cred = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
            req.push_str(&format!("Proxy-Authorization: Basic {cred}\r\n"));
        }
        req.push_str("\r\n");
        io.write_all(req.as_bytes()).await?;
        io.flush().await?;
        // Read the answer head byte by byte: nothing past it may be consumed,
        // it belongs to the TLS handshake that follows.
        let mut head = Vec::with_capacity(256);
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() >= MAX_RESPONSE_HEAD {
                return Err(TunnelError::TooLarge {
                    what: "proxy answer",
                    len: head.len(),
                    max: MAX_RESPONSE_HEAD,
                });
            }
            let b = io.read_u8().await.map_err(|_| {
                TunnelError::Proxy(format!(
                    "proxy {} closed the connection before answering CONNECT {target}",
                    self.display()
                ))
            })?;
            head.push(b);
        }
        let status_line = String::from_utf8_lossy(&head)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned();
        let code = status_line.split_whitespace().nth(1).unwrap_or("");
        if code != "200" {
            let hint = if code == "407" || code == "401" {
                " (proxy credentials missing or wrong)"
            } else {
                ""
            };
            return Err(TunnelError::Proxy(format!(
                "proxy {} refused CONNECT {target}: {status_line}{hint}",
                self.display()
            )));
        }
        Ok(io)
    }
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) if bits <= 32 => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(a) & mask == u32::from(b) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(b)) if bits <= 128 => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

/// Connects to `host:port` (at `addr`), through `proxy` unless it is
/// bypassed; says whether the proxy was used.
pub async fn tcp(
    host: &str,
    port: u16,
    addr: std::net::SocketAddr,
    proxy: Option<&Proxy>,
) -> Result<(Box<dyn Io>, bool)> {
    match proxy {
        Some(p) if !p.bypass(host, port) => Ok((p.connect(host, port).await?, true)),
        _ => {
            let tcp = TcpStream::connect(addr).await?;
            let _ = tcp.set_nodelay(true);
            Ok((Box::new(tcp), false))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(no_proxy: &str) -> Proxy {
        Proxy::new(
            Url::parse("http://user:p%40ss@proxy.local:3128").unwrap(),
            no_proxy,
        )
        .unwrap()
    }

    #[test]
    fn no_proxy_rules() {
        let proxy =
            p("localhost, .internal.example, corp.example:8444, 10.0.0.0/8, ::1, 192.168.1.7");
        assert!(proxy.bypass("localhost", 1));
        assert!(proxy.bypass("hub.internal.example", 1));
        assert!(proxy.bypass("internal.example", 1));
        assert!(!proxy.bypass("notinternal.example", 1));
        assert!(proxy.bypass("corp.example", 8444));
        assert!(!proxy.bypass("corp.example", 443));
        assert!(proxy.bypass("10.1.2.3", 1));
        assert!(!proxy.bypass("11.1.2.3", 1));
        assert!(proxy.bypass("[::1]", 1));
        assert!(proxy.bypass("192.168.1.7", 1));
        assert!(!proxy.bypass("hub.example.com", 1));
        assert!(p("*").bypass("anything", 1));
        assert!(!p("").bypass("anything", 1));
    }

    #[test]
    fn credentials_stay_out_of_logs() {
        let proxy = p("");
        assert_eq!(proxy.display(), "http://proxy.local:3128/");
        assert!(!format!("{proxy:?}").contains("p%40ss"));
        assert!(Proxy::new(Url::parse("socks5://x:1").unwrap(), "").is_err());
        let https = Proxy::new(Url::parse("https://u:pw@proxy.local").unwrap(), "").unwrap();
        assert!(https.is_https());
        assert_eq!(https.display(), "https://proxy.local/");
    }
}
