//! Why a tunnel ended, and who ended it: the hub, a proxy on the way, or
//! the network. Sans IO.
//!
//! Over TCP every close looks alike (a FIN or a reset), whoever made it, so
//! the hub says goodbye on the tunnel before it closes one
//! ([`otter_tunnel::frame::TARGET_BYE`]); a close without that goodbye was
//! made by something on the way. QUIC needs no goodbye: its close frame is
//! authenticated, so only the hub can have sent it.

use std::fmt;

#[cfg(test)]
use otter_tunnel::TunnelError;
use otter_tunnel::{ConnectionEnd, TunnelStream};

/// Who ended a tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndedBy {
    /// The hub closed it, saying why.
    Hub,
    /// The connection through an HTTP proxy was closed or reset without
    /// the hub's goodbye.
    Proxy,
    /// The path went silent (keepalives unanswered), or a direct connection
    /// was closed or reset without the hub's goodbye (the hub's process
    /// ended, or something on the path cut it).
    Network,
}

impl EndedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            EndedBy::Hub => "hub",
            EndedBy::Proxy => "proxy",
            EndedBy::Network => "network",
        }
    }
}

impl fmt::Display for EndedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tunnel's end: who, and why in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub by: EndedBy,
    pub why: String,
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.by, self.why)
    }
}

/// What the acceptor's last `accept` returned once the tunnel ended.
pub type Outcome = otter_tunnel::Result<Option<TunnelStream>>;

/// Names who ended a tunnel from how its acceptor ended, the hub's goodbye
/// if one came, and the proxy the tunnel went through (`None`: direct).
pub fn classify(outcome: &Outcome, goodbye: Option<String>, proxy: Option<&str>) -> Ended {
    let hub = |why: String| Ended {
        by: EndedBy::Hub,
        why: if why.is_empty() {
            "closed the tunnel".into()
        } else {
            why
        },
    };
    if let Some(why) = goodbye {
        return hub(why);
    }
    let cut = |what: String| match proxy {
        Some(p) => Ended {
            by: EndedBy::Proxy,
            why: format!("{what} through the proxy {p}, without the hub's goodbye"),
        },
        None => Ended {
            by: EndedBy::Network,
            why: format!(
                "{what} without the hub's goodbye (the hub's process ended, or something on the path cut it)"
            ),
        },
    };
    let Err(e) = outcome else {
        return cut("the connection was closed".into());
    };
    match e.connection_end() {
        ConnectionEnd::PeerClosed(why) => hub(why),
        ConnectionEnd::Silent(why) => Ended {
            by: EndedBy::Network,
            why: format!("the path went silent: {why}"),
        },
        ConnectionEnd::Broken(why) => cut(format!("the connection failed ({why})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eof() -> Outcome {
        Ok(None)
    }

    #[test]
    fn a_goodbye_names_the_hub_whatever_the_connection_did() {
        let e = classify(
            &eof(),
            Some("the link was deleted".into()),
            Some("http://p:3128/"),
        );
        assert_eq!(e.by, EndedBy::Hub);
        assert_eq!(e.to_string(), "hub: the link was deleted");
        let reset = Err(TunnelError::Io(std::io::ErrorKind::ConnectionReset.into()));
        assert_eq!(classify(&reset, Some(String::new()), None).by, EndedBy::Hub);
    }

    #[test]
    fn a_close_without_goodbye_is_the_proxy_or_the_network() {
        let via = classify(&eof(), None, Some("http://p:3128/"));
        assert_eq!(via.by, EndedBy::Proxy);
        assert!(via.why.contains("http://p:3128/"), "{via}");
        assert_eq!(classify(&eof(), None, None).by, EndedBy::Network);
        let reset = Err(TunnelError::Io(std::io::ErrorKind::ConnectionReset.into()));
        assert_eq!(classify(&reset, None, Some("http://p/")).by, EndedBy::Proxy);
    }

    #[test]
    fn silence_is_the_network_even_through_a_proxy() {
        let ka = Err(TunnelError::Closed(
            "no answer to a keepalive within 3s".into(),
        ));
        let e = classify(&ka, None, Some("http://p/"));
        assert_eq!(e.by, EndedBy::Network);
        assert!(e.why.contains("keepalive"), "{e}");
    }
}
