//! Why a connection to the hub failed, said so a person can act on it.
//!
//! A refused port, a name that does not resolve, a certificate from an
//! unknown CA, one for another name, an expired one and a silent address
//! all reach the caller as "transport error" from the gRPC stack. The cause
//! is somewhere in the error's chain; this finds it and says what to do,
//! the same way in the `otter` CLI and in the agent's log.

use std::error::Error;

/// What the caller trusts the hub with, for the unknown-CA fix: the flag
/// or file that holds the hub CA where this runs.
#[derive(Debug, Clone, Copy)]
pub struct CaHint<'a>(pub &'a str);

/// One line naming the cause of a failed connection to `host:port`, with
/// the fix; `None` when the chain holds no cause of a known kind.
pub fn why_unreachable(
    e: &(dyn Error + 'static),
    host: &str,
    port: u16,
    ca: CaHint<'_>,
) -> Option<String> {
    let mut current = Some(e);
    while let Some(err) = current {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return tls_cause(tls, host, ca);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(said) = io_cause(io, host, port) {
                return Some(said);
            }
            // An io::Error's own source skips the error it wraps.
            if let Some(inner) = io.get_ref()
                && let Some(said) = why_unreachable(inner, host, port, ca)
            {
                return Some(said);
            }
        }
        if err.is::<tokio::time::error::Elapsed>() || err.to_string().contains("timed out") {
            return Some(timed_out(host, port));
        }
        current = err.source();
    }
    None
}

fn timed_out(host: &str, port: u16) -> String {
    format!(
        "no answer from {host}:{port} in time: a firewall dropping the packets, the wrong \
         port, or a hub too busy to answer; check that the port is open from here"
    )
}

fn io_cause(io: &std::io::Error, host: &str, port: u16) -> Option<String> {
    use std::io::ErrorKind as K;
    match io.kind() {
        K::ConnectionRefused => Some(format!(
            "nothing listens at {host}:{port} (connection refused): is the hub running, \
             and does it serve that port?"
        )),
        K::TimedOut => Some(timed_out(host, port)),
        _ => {
            // The resolver's failure comes as an uncategorised error.
            let text = io.to_string();
            (text.contains("failed to lookup address")
                || text.contains("Name or service not known"))
            .then(|| {
                format!(
                    "the name {host} does not resolve (DNS): check the host name in the URL, \
                         and the DNS servers of this machine"
                )
            })
        }
    }
}

fn tls_cause(e: &rustls::Error, host: &str, ca: CaHint<'_>) -> Option<String> {
    use rustls::CertificateError as C;
    let rustls::Error::InvalidCertificate(cert) = e else {
        return None;
    };
    Some(match cert {
        C::UnknownIssuer => format!(
            "the certificate {host} shows is not from a CA trusted here: give the hub's CA \
             ({}), or check that nothing between here and the hub re-signs TLS",
            ca.0
        ),
        C::NotValidForName | C::NotValidForNameContext { .. } => format!(
            "the certificate {host} shows is for another name: use the host name the hub's \
             certificate names (its --external-url), or add {host} to it"
        ),
        C::Expired | C::ExpiredContext { .. } => format!(
            "the certificate {host} shows has expired (or this machine's clock is ahead): \
             renew the hub's certificate, or set this clock (NTP)"
        ),
        C::NotValidYet | C::NotValidYetContext { .. } => format!(
            "the certificate {host} shows is not valid yet (or this machine's clock is behind): \
             set this clock (NTP)"
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wrapped(e: impl Error + Send + Sync + 'static) -> Box<dyn Error + 'static> {
        // As the gRPC stack hands it over: an io::Error inside another error.
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl Error for Outer {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&self.0)
            }
        }
        Box::new(Outer(std::io::Error::other(e)))
    }

    #[test]
    fn each_cause_has_its_own_line() {
        let ca = CaHint("--ca-file");
        let say = |e: Box<dyn Error>| why_unreachable(&*e, "hub.example", 8443, ca).unwrap();
        let refused = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(say(refused).contains("connection refused"));
        let cert = |c| wrapped(rustls::Error::InvalidCertificate(c));
        assert!(say(cert(rustls::CertificateError::UnknownIssuer)).contains("--ca-file"));
        assert!(say(cert(rustls::CertificateError::NotValidForName)).contains("another name"));
        assert!(say(cert(rustls::CertificateError::Expired)).contains("expired"));
        let dns = std::io::Error::other(
            "failed to lookup address information: Name or service not known",
        );
        assert!(say(Box::new(dns)).contains("does not resolve"));
        assert!(
            say(Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut))).contains("no answer")
        );
        let other = std::io::Error::other("something else");
        assert!(why_unreachable(&other, "h", 1, ca).is_none());
    }
}
