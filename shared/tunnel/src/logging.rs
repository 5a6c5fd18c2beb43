//! The binaries' log output (the hub's `otter` and `otter-agent` alike):
//! human lines, or one JSON object a line for log collectors, on stderr.

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human lines; colours only on a terminal (log collectors such as
    /// `kubectl logs` or files would keep the escape codes).
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = crate::TunnelError;

    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(crate::TunnelError::UnknownLogFormat(other.to_owned())),
        }
    }
}

/// Kept below a default level: quinn's socket layer warns of a datagram
/// the kernel refused (a hub that is down refuses every one an agent
/// sends), at most once a minute per socket. The line names no cluster and
/// says less than the agent's own: the agent reads those refusals itself,
/// and says which hub went away and when it dials again. A process with
/// many sockets (the bench's thousands of simulated agents after a crash)
/// printed one per socket. Any `OTTER_LOG` replaces this default, so
/// `OTTER_LOG=info` shows them.
const QUIETER: &str = "quinn_udp=error";

/// What is logged unless `OTTER_LOG` says otherwise: `level` for all but
/// [`QUIETER`]'s targets.
fn default_filter(level: &str) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::new(format!("{level},{QUIETER}"))
}

/// The filter `OTTER_LOG` sets, else [`default_filter`] at `level`.
pub fn filter(level: &str) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_env("OTTER_LOG")
        .unwrap_or_else(|_| default_filter(level))
}

/// Starts logging to stderr at the level `OTTER_LOG` says (default info).
pub fn init(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter("info"))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use super::*;

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn refused_sends_stay_out_of_the_default_log_and_errors_do_not() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(default_filter("info"))
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "quinn_udp", "sendmsg error: connection refused");
            tracing::error!(target: "quinn_udp", "a socket that cannot be used");
            tracing::warn!(target: "otter_agent::tunnel", "the hub went away");
            tracing::info!(target: "otter_tunnel::quic", "dialling again");
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("sendmsg error"), "{text}");
        for kept in [
            "a socket that cannot be used",
            "the hub went away",
            "dialling again",
        ] {
            assert!(text.contains(kept), "{kept:?} missing from {text}");
        }
    }
}
