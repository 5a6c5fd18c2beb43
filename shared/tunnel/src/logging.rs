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

/// Starts logging to stderr at the level `OTTER_LOG` says (default info).
pub fn init(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("OTTER_LOG").unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}
